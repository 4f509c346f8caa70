"""Stage bodies of the training loops, one function per stage, each taking a ``StageCall``.

``sft`` (generate, score, select, train) and ``dpo`` (probe, search, pairs, train) hold the stages,
``reward_stage`` the scoring of generated conversations (the formula itself is ``optima.reward``), and ``common``
what both loops share (the train stage, the LM-loss scorer, the MATH verifier). The stage tables of
``optima.plan`` list them in order; ``optima.pipeline`` runs them under the iteration manifest.
"""
