"""Training-data selection: the best conversations for SFT (``sft``), preference pairs for DPO (``dpo``) from
the tree search (``mcts``, over the nodes and records of ``tree``; its rollouts are scored by
``rollout_reward``)."""
