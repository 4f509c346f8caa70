"""Values derived from a recipe (optima/config/rules.py) that several layers share."""

from __future__ import annotations

from optima.config.rules import tokenizer_path


def test_tokenizer_path_falls_back_from_the_agent_to_the_model_to_the_initial_model(make_recipe):
    plain = make_recipe()
    assert tokenizer_path(plain) == tokenizer_path(plain, 1) == str(plain.initial_model_path)
    assert tokenizer_path(plain, model="served") == "served"  # the served or evaluated model's own
    named = make_recipe(tokenizer_first_path="alice_tok", tokenizer_second_path="bob_tok")
    # (the recipe resolves relative paths)
    assert tokenizer_path(named, model="served") == named.tokenizer_first_path
    assert tokenizer_path(named, 1, model="served") == named.tokenizer_second_path
    assert named.tokenizer_first_path.endswith("alice_tok") and named.tokenizer_second_path.endswith("bob_tok")
    only_alice = make_recipe(tokenizer_first_path="alice_tok")
    assert tokenizer_path(only_alice, 1) == str(only_alice.initial_model_path)  # Bob keeps the model's own
