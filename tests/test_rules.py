"""Values derived from a recipe (optima/config/rules.py) that several layers share."""

from __future__ import annotations

import pytest

from optima.config.rules import tokenizer_path, vllm_dtype_arg


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


@pytest.mark.parametrize(
    ("args", "expected"),
    [([], None), (["--dtype", "bfloat16"], "bfloat16"), (["--seed", "1", "--dtype=half"], "half"), (["--dtype"], "")],
)
def test_vllm_dtype_arg_reads_both_spellings(args, expected):
    assert vllm_dtype_arg(args) == expected


@pytest.mark.parametrize(
    ("args", "expected"), [([], 2), (["--dtype", "float32"], 4), (["--dtype=auto"], 2), (["--dtype", "nope"], 2)]
)
def test_served_dtype_bytes_reads_the_one_table(args, expected):
    from optima.hardware.memory import served_dtype_bytes

    assert served_dtype_bytes(args) == expected
