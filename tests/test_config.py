"""Recipe loading and validation: every shipped recipe loads, every bad recipe fails with one clear message."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from optima.config import DPORecipe, InferenceRecipe, MultiSCRecipe, RecipeError, SFTDPORecipe, SFTRecipe, load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPE_CLASSES = {"sft_recipes": SFTRecipe, "dpo_recipes": DPORecipe, "sft_dpo_recipes": SFTDPORecipe}
SHIPPED = sorted((REPO / "train").glob("*_recipes/*.yaml"))
TASK_NAMES = ("hotpot_qa", "mwh_qa", "trival_qa", "cbt", "gsm8k", "math", "arc", "mmlu")


@pytest.fixture
def in_repo(monkeypatch):
    """Recipes use paths relative to the repository root, as users run them."""
    monkeypatch.chdir(REPO)


@pytest.fixture
def write_recipe(tmp_path):
    """Write a recipe dict (or raw text) to a YAML file and return its path."""

    def write(content: dict | str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        return path

    return write


def minimal_sft(**extra) -> dict:
    base = {
        "dataset_type": "arc",
        "initial_model_path": "./models/SmolLM2-135M-Instruct",
        "origin_yaml_path": "alignment-handbook/recipes/smollm2-135m/arc_sft/base.yaml",
        "data_dir": str(REPO / "data"),
    }
    return base | extra


def test_every_task_and_method_has_a_recipe():
    for folder in RECIPE_CLASSES:
        names = {p.stem for p in (REPO / "train" / folder).glob("*.yaml")}
        assert set(TASK_NAMES) <= names, f"{folder} lacks {set(TASK_NAMES) - names}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_recipe_loads(path, in_repo):
    recipe = load_recipe(RECIPE_CLASSES[path.parent.name], path, check_paths=False)
    assert recipe.dataset_type in TASK_NAMES
    assert Path(recipe.output_dir).is_absolute()
    # Base trainer YAMLs referenced by shipped recipes exist.
    for name in ("origin_yaml_path", "origin_dpo_yaml_path"):
        value = getattr(recipe, name, None)
        if value is not None:
            assert Path(value).is_file(), f"{path}: {name} {value} missing"


def test_paper_values_reach_the_recipe(in_repo):
    """Spot-check the original's released values: ARC iSFT and math iSFT-DPO."""
    arc = load_recipe(SFTRecipe, REPO / "train/sft_recipes/arc.yaml", check_paths=False)
    assert (arc.initial_epsilon, arc.sample_count, arc.explore_count, arc.thread_count) == (0.6, 2000, 15, 1024)
    assert (arc.lambda1, arc.lambda2, arc.from_initial, arc.iteration_times) == (-0.5, 0.6, True, 6)
    math = load_recipe(SFTDPORecipe, REPO / "train/sft_dpo_recipes/math.yaml", check_paths=False)
    assert (math.initial_dpo_epsilon, math.monte_sample_count, math.lambda2) == (0.45, 7000, 0.9)


def test_original_sft_recipe_keys_are_accepted(in_repo, caplog):
    with caplog.at_level(logging.WARNING):
        recipe = load_recipe(SFTRecipe, REPO / "tests/data/original_sft_arc.yaml", check_paths=False)
    assert recipe.initial_epsilon == 0.6  # read from initial_episilon
    assert recipe.cal_ppl is True and recipe.from_initial is True  # 1 / True
    assert recipe.devices == list(range(8))  # the original's devices: 7 = GPUs 0..7
    assert recipe.check_point_root_path == str(REPO / "checkpoints/arc_sft")
    assert "initial_episilon" in caplog.text and "mid_jsonl_root_path" in caplog.text


def test_original_dpo_recipe_keys_are_accepted(in_repo, caplog):
    with caplog.at_level(logging.WARNING):
        recipe = load_recipe(DPORecipe, REPO / "tests/data/original_dpo_arc.yaml", check_paths=False)
    assert recipe.initial_dpo_epsilon == 0.45 and recipe.initial_dpo_min_value == 0.2
    assert recipe.mcts_selections == 8  # honours explore_count
    assert "not used by DPORecipe" in caplog.text


def test_method_defaults_differ_where_the_original_did(in_repo):
    dpo = load_recipe(DPORecipe, REPO / "train/dpo_recipes/arc.yaml", check_paths=False)
    sft_dpo = load_recipe(SFTDPORecipe, REPO / "train/sft_dpo_recipes/arc.yaml", check_paths=False)
    assert (dpo.rpo_alpha, dpo.token_quantile) == (1.0, 0.85)
    assert (sft_dpo.rpo_alpha, sft_dpo.token_quantile, sft_dpo.mcts_selections) == (None, 0.8, 8)


def test_precedence_default_yaml_cli(write_recipe, in_repo):
    path = write_recipe(minimal_sft(explore_count=4))
    recipe = load_recipe(SFTRecipe, path, ["explore_count=7", "lambda1=-0.3"])
    assert recipe.explore_count == 7 and recipe.lambda1 == -0.3
    assert recipe.max_turns == 10  # dataclass default
    assert load_recipe(SFTRecipe, path).explore_count == 4


def test_relative_paths_resolve_against_the_working_directory(write_recipe, tmp_path, monkeypatch, in_repo):
    path = write_recipe(minimal_sft(output_dir="runs/x"))
    recipe = load_recipe(SFTRecipe, path)
    assert recipe.output_dir == str(REPO / "runs/x")
    assert recipe.initial_model_path == str((REPO / "models/SmolLM2-135M-Instruct").resolve())  # models/ may be a link
    monkeypatch.chdir(tmp_path)
    elsewhere = load_recipe(SFTRecipe, path, check_paths=False)
    assert elsewhere.output_dir == str(tmp_path / "runs/x")


def test_hub_ids_are_not_paths(write_recipe, in_repo):
    recipe = load_recipe(
        SFTRecipe, write_recipe(minimal_sft(initial_model_path="meta-llama/Meta-Llama-3-8B-Instruct"))
    )
    assert recipe.initial_model_path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert "initial_model_path" not in recipe.input_paths()


def test_data_dir_defaults_to_the_environment(write_recipe, monkeypatch, tmp_path, in_repo):
    monkeypatch.setenv("OPTIMA_DATA_DIR", str(tmp_path))
    content = minimal_sft()
    del content["data_dir"]
    assert load_recipe(SFTRecipe, write_recipe(content)).data_dir == str(tmp_path)


def test_trivia_alias_is_canonicalised(write_recipe, in_repo):
    recipe = load_recipe(SFTRecipe, write_recipe(minimal_sft(dataset_type="trivia_qa")))
    assert recipe.dataset_type == "trival_qa"


@pytest.mark.parametrize(
    ("content", "field", "fragment"),
    [
        (minimal_sft(explor_count=3), "explor_count", "did you mean 'explore_count'"),
        (minimal_sft(explore_count="many"), "explore_count", "expected int, got 'many'"),
        (minimal_sft(lambda1="x"), "lambda1", "expected float, got 'x'"),
        (minimal_sft(cal_ppl=2), "cal_ppl", "expected bool, got 2"),
        (minimal_sft(explore_count=0), "explore_count", "must be >= 1, got 0"),
        (minimal_sft(temperature=3.5), "temperature", "must be in [0.0, 2.0], got 3.5"),
        (minimal_sft(lambda1=0.4), "lambda1", "must be <= 0"),
        (minimal_sft(port=70000), "port", "must be in [1, 65535], got 70000"),
        (minimal_sft(selection_range=[0.8, 0.1]), "selection_range", "got [0.8, 0.1]"),
        (minimal_sft(dataset_type="squad"), "dataset_type", "unknown task 'squad'"),
        (minimal_sft(devices="0,x"), "devices", "got '0,x'"),
        (minimal_sft(devices=[1, 1]), "devices", "lists a GPU twice"),
        (minimal_sft(host="0.0.0.0"), "host", "set api_key too"),
        (minimal_sft(endpoints=["localhost:8000"]), "endpoints", "not an http(s) URL: 'localhost:8000'"),
        (minimal_sft(compat="old"), "compat", "one of 'default', 'original', got 'old'"),
        (minimal_sft(initial_epsilon=0.5, initial_episilon=0.6), "initial_episilon", "keep 'initial_epsilon'"),
        (minimal_sft(data_dir="/nonexistent/data"), "data_dir", "input path does not exist: /nonexistent/data"),
        (minimal_sft(initial_model_path="./no/such/model"), "initial_model_path", "input path does not exist"),
        (minimal_sft(origin_yaml_path="nope.yaml"), "origin_yaml_path", "nope.yaml"),
        ({k: v for k, v in minimal_sft().items() if k != "dataset_type"}, "dataset_type", "is required"),
        ({k: v for k, v in minimal_sft().items() if k != "origin_yaml_path"}, "origin_yaml_path", "is required"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_bad_recipe_names_file_field_and_value(write_recipe, in_repo, content, field, fragment):
    path = write_recipe(content)
    with pytest.raises(RecipeError) as info:
        load_recipe(SFTRecipe, path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: "), message
    assert fragment in message, message
    assert info.value.field == field


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("- a\n- b\n", "must be a mapping"), ("key: [unclosed\n", "not valid YAML"), ("", "is required")],
)
def test_bad_recipe_file(write_recipe, text, fragment):
    with pytest.raises(RecipeError, match="recipe.yaml") as info:
        load_recipe(SFTRecipe, write_recipe(text))
    assert fragment in str(info.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(SFTRecipe, tmp_path / "absent.yaml")


def test_bad_override_is_reported():
    with pytest.raises(RecipeError, match="--set expects key=value, got 'explore_count'"):
        load_recipe(SFTRecipe, None, ["explore_count"])


def test_dpo_recipe_validation(write_recipe, in_repo):
    content = {
        "dataset_type": "arc",
        "initial_model_path": "org/model",
        "origin_dpo_yaml_path": "alignment-handbook/recipes/smollm2-135m/arc_dpo/base.yaml",
        "token_quantile": 1.5,
    }
    with pytest.raises(RecipeError, match="token_quantile: must be in"):
        load_recipe(DPORecipe, write_recipe(content))


def test_eval_recipes(tmp_path, in_repo):
    (tmp_path / "iteration_0").mkdir()
    sweep = load_recipe(InferenceRecipe, None, {"dataset_type": "gsm8k", "model_root_path": str(tmp_path)})
    assert sweep.output_root_path == str(tmp_path / "eval") and sweep.initial_model_path is None
    sc = load_recipe(MultiSCRecipe, None, {"dataset_type": "arc", "model_root_path": str(tmp_path), "num_samples": 4})
    assert (sc.num_samples, sc.sc_temperature) == (4, 0.5)
    with pytest.raises(RecipeError, match="model_root_path: input path does not exist"):
        load_recipe(InferenceRecipe, None, {"dataset_type": "arc", "model_root_path": str(tmp_path / "none")})


def test_recipe_round_trips_through_yaml(write_recipe, in_repo, tmp_path):
    """``recipe.yaml`` saved in a run directory loads back into the same recipe."""
    recipe = load_recipe(SFTRecipe, write_recipe(minimal_sft()))
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(recipe.to_dict()))
    assert load_recipe(SFTRecipe, saved) == recipe


def test_evaluation_recipes_have_only_the_fields_they_use(write_recipe, tmp_path, caplog):
    """The loops' sampling and loop fields are no evaluation field: set in a recipe, each is ignored with a warning
    naming the file, the key and its value (it is not even type-checked: evaluation never reads it)."""
    import dataclasses

    from optima.config import LOOP_ONLY_KEYS

    loop_only = list(LOOP_ONLY_KEYS)
    assert len(loop_only) == 13 and set(loop_only) <= {f.name for f in dataclasses.fields(SFTRecipe)}
    for cls in (InferenceRecipe, MultiSCRecipe):
        assert not set(loop_only) & {f.name for f in dataclasses.fields(cls)}
    path = write_recipe({"dataset_type": "arc", "model_root_path": str(tmp_path)} | dict.fromkeys(loop_only, "x"))
    with caplog.at_level(logging.WARNING):
        recipe = load_recipe(MultiSCRecipe, path, check_paths=False)
    for name in loop_only:
        assert f"{path}: {name}='x' is not used by MultiSCRecipe; ignored" in caplog.text
        assert not hasattr(recipe, name)
    with pytest.raises(RecipeError, match="unknown key for InferenceRecipe"):
        load_recipe(InferenceRecipe, None, {"dataset_type": "arc", "model_root_path": str(tmp_path), "lambda1": -1})


def test_every_field_has_a_type_a_help_and_a_line_in_its_class_docstring():
    """TRL's format: each class's docstring lists its own fields (name, type, default) from their help."""
    import dataclasses

    for cls in (SFTRecipe, DPORecipe, SFTDPORecipe, InferenceRecipe, MultiSCRecipe):
        docs = "".join(klass.__doc__ or "" for klass in cls.__mro__)
        for f in dataclasses.fields(cls):
            assert f.type and f.metadata["help"], f.name
            assert f"        {f.name} (`{f.type}`" in docs, f"{cls.__name__}.{f.name} is not in a docstring"
    base = InferenceRecipe.__mro__[1].__doc__  # _BaseRecipe's
    assert "        seed (`int`, defaults to `42`):\n            Seed of every random choice" in base
    assert "        dataset_type (`str`):\n" in base  # required: no default
    assert "token_quantile (`float`, defaults to `0.8`)" in SFTDPORecipe.__doc__  # its own default, not DPO's
