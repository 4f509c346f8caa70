"""One loop drives both ``--dry-run`` and the run: the stages run in the order the plan prints them, with the settings
it prints; derived values come from one rule each."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from optima import loop, stages
from optima.agents.generation import generation_settings
from optima.config import DPORecipe, InferenceRecipe, SFTDPORecipe, SFTRecipe, field, load_recipe, rules, stage_fields
from optima.methods import DPO, SFT, TRAINER_STAGES, Stage
from optima.reward import question_t_max
from optima.run import build_run, stage_settings
from optima.stages import RewardScorers, reward_generations, reward_question
from optima.tasks.answers import PARSER_VERSION
from tests.helpers import arc_examples
from tests.test_pipeline import EMPTY_SELECTION, TRAIN_ENV

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "alignment-handbook" / "recipes" / "smollm2-135m"
CLASSES = {"sft": SFTRecipe, "dpo": DPORecipe, "sft_dpo": SFTDPORecipe}

# The field lists the stages had before the table derived them from the recipe fields: a finished run directory
# must keep resuming (its manifest hashes these fields), so the derived lists must not drift. What a stage reads
# besides its fields (the model it samples from, e.g. iDPO's probe from initial_model_path) is part of its key
# through its inputs (optima.stage_identity; tests/test_resume_inputs.py).
SFT_BEFORE = {
    "generate": {"dataset_type", "data_dir", "seed", "temperature", "max_turns", "max_tokens", "served_model_name",
                 "initial_model_path", "sample_count", "explore_count", "temperature_iteration0", "use_prompt_pool",
                 "prompt_pool_path", "answer_bootstrap", "answer_bootstrap_iterations"},
    "score": {"lambda1", "lambda2", "cal_ppl", "loss_backend", "loss_model_path", "min_tokens", "max_total_tokens",
              "overlong_penalty", "compat", "impersonation_penalty"},
    "select": {"initial_epsilon", "selection_range", "sft_train_fraction"},
    "train": {"from_initial", "accelerate_config", "origin_yaml_path", "trainer_overrides"},
}  # fmt: skip
DPO_BEFORE = {
    "probe": {"dataset_type", "data_dir", "seed", "temperature", "max_turns", "max_tokens", "served_model_name",
              "probe_count", "token_quantile"},
    "search": {"lambda1", "lambda2", "cal_ppl", "loss_backend", "loss_model_path", "min_tokens", "max_total_tokens",
               "overlong_penalty", "compat", "monte_sample_count", "mcts_selections", "mcts_rollouts", "mcts_top_k",
               "diversity_threshold", "merge_threshold"},
    "pairs": {"initial_dpo_min_value", "initial_dpo_epsilon", "dpo_keep_fraction", "dpo_train_fraction"},
    "train": {"from_initial", "accelerate_config", "origin_dpo_yaml_path", "rpo_alpha", "trainer_overrides"},
}  # fmt: skip


def dry_run(recipe, gpu: bool | None = False) -> str:
    """What ``--dry-run`` prints for ``recipe`` (on this machine without its GPUs unless ``gpu`` is None)."""
    return loop.render_plan(build_run(recipe, {"train": TRAIN_ENV}, gpu=gpu))


def make_recipe(tmp_path: Path, method: str, **overrides):
    values = {
        "dataset_type": "arc",
        "initial_model_path": str(tmp_path / "base_model"),
        "output_dir": str(tmp_path / "run"),
        "iteration_times": 2,
        "preflight": False,  # the tests here replace the stages, the trainer's among them
    }
    if method in ("sft", "sft_dpo"):
        values["origin_yaml_path"] = str(
            RECIPES / ("arc_sft_dpo/sft" if method == "sft_dpo" else "arc_sft") / "base.yaml"
        )
    if method in ("dpo", "sft_dpo"):
        values["origin_dpo_yaml_path"] = str(
            RECIPES / ("arc_sft_dpo/dpo" if method == "sft_dpo" else "arc_dpo") / "base.yaml"
        )
    return load_recipe(CLASSES[method], None, values | overrides, check_paths=False)


def test_stage_fields_come_from_the_recipe_fields_and_match_what_runs_resumed_with():
    assert {stage: set(stage_fields(stage, SFTRecipe)) for stage in TRAINER_STAGES[SFT]} == SFT_BEFORE
    assert {stage: set(stage_fields(stage, DPORecipe)) for stage in TRAINER_STAGES[DPO]} == DPO_BEFORE
    # iSFT-DPO redefines two DPO fields; they keep their stage.
    for name in ("rpo_alpha", "token_quantile"):
        ours = {f.name: f for f in dataclasses.fields(SFTDPORecipe)}[name].metadata["redoes"]
        assert ours == {f.name: f for f in dataclasses.fields(DPORecipe)}[name].metadata["redoes"]


def test_a_redoes_tag_must_name_a_stage():
    with pytest.raises(ValueError, match="no stage named 'generat'"):  # when the class is defined: at import

        @dataclasses.dataclass
        class Misspelt:
            sample_count: int = field(100, help="questions", redoes=("generat",))

    assert field(1, redoes=("generate",)).metadata["redoes"] == (Stage.GENERATE,)
    # The tags of every loop recipe and the stages of the loops are the same set: the enum.
    tags = {tag for cls in CLASSES.values() for f in dataclasses.fields(cls) for tag in f.metadata["redoes"]}
    names = set(TRAINER_STAGES[SFT] + TRAINER_STAGES[DPO])
    assert tags == names == set(Stage)
    assert all(isinstance(name, Stage) for name in names | tags)


def test_the_dry_run_shows_the_generation_settings_the_stage_runs(tmp_path):
    recipe = make_recipe(tmp_path, "sft", temperature_iteration0=0.2, answer_bootstrap="grammar")
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    settings = [stage_settings(part)[Stage.GENERATE] for part in loop.planned_parts(run)]
    shown = [s.show for s in settings]
    runs = [s.generation for s in settings]  # what the generate stage hands generate_conversations
    assert [(s["temperature"], s["conversations per question"]) for s in shown] == [(0.2, 10), (0.7, 10)]
    assert [(g.temperature, g.samples) for g in runs] == [(0.2, 10), (0.7, 10)]
    assert runs == [generation_settings(recipe, i) for i in range(2)]  # the one rule of docs/method.md
    assert [(s["prompt pool"], s["answer bootstrap"]) for s in shown] == [("built-in", "grammar"), ("off", "off")]
    assert [(g.use_prompt_pool, g.answer_bootstrap) for g in runs] == [(True, "grammar"), (False, "off")]
    # Describing every stage made nothing.
    assert loop.render_plan(run)
    assert not Path(recipe.output_dir).exists()


BODIES = ("generate", "score", "select", "probe", "search", "pairs", "train")


def recording_stages(monkeypatch, seen: list | None = None) -> list[tuple[int, str | None, str]]:
    """Replace every stage body by one that records (iteration, part, stage) and leaves something to train; ``seen``
    gets each stage's name, part, settings and further arguments."""
    ran: list[tuple[int, str | None, str]] = []

    def recorder(name):
        def body(part, settings, *more):
            ran.append((part.iteration, part.name, name))
            if seen is not None:
                seen.append((name, part, settings, more))
            return {"kept_conversations": 1, "pairs_kept": 1, "t_max": 10, "stage": name}

        return body

    for name in BODIES:
        monkeypatch.setattr(stages, name, recorder(name))
    monkeypatch.setattr(loop, "check_env", lambda env, role: None)
    return ran


@pytest.mark.parametrize("method", ["sft", "dpo", "sft_dpo"])
@pytest.mark.parametrize("skip", [0, 1])
def test_the_run_follows_the_dry_run(tmp_path, monkeypatch, method, skip):
    ran = recording_stages(monkeypatch)
    recipe = make_recipe(tmp_path, method)
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    printed = re.findall(r"^  \[(\w+)\]$", loop.render_plan(run, skip), flags=re.MULTILINE)
    loop.run_loop(run, skip)

    assert [name for name in printed if name not in ("serve", "skip")] == [name for _, _, name in ran]
    assert printed.count("skip") == skip
    expected = {"sft": ["generate", "score", "select", "train"], "dpo": ["probe", "search", "pairs", "train"]}
    per_iteration = expected.get(method) or expected["sft"] + expected["dpo"]
    assert [name for _, _, name in ran] == per_iteration * (2 - skip)
    parts = [(part.iteration, part.name) for part in loop.planned_parts(run) if part.iteration >= skip]
    assert list(dict.fromkeys((i, name) for i, name, _ in ran)) == parts


def test_each_stage_runs_with_the_settings_the_dry_run_prints(tmp_path, monkeypatch):
    """Every stage gets its part (the model it really starts from) and its settings, the very values --dry-run
    prints, frozen; the tree search gets the probe's T_max."""
    seen: list = []
    recording_stages(monkeypatch, seen)
    recipe = make_recipe(tmp_path, "sft_dpo", iteration_times=1)
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    loop.run_loop(run)
    assert [name for name, *_ in seen] == ["generate", "score", "select", "train", "probe", "search", "pairs", "train"]
    planned = loop.planned_parts(run)
    for name, part, settings, _ in seen:
        (plan,) = [p for p in planned if (p.iteration, p.name) == (part.iteration, part.name)]
        assert part.model == plan.model and settings.show == stage_settings(plan)[name].show
        assert part.run is run
    (search,) = [(settings, more) for name, _, settings, more in seen if name == "search"]
    assert search[1] == (10,) and search[0].loss.where == "loss server"  # the probe's T_max; the loss server
    with pytest.raises(dataclasses.FrozenInstanceError):
        search[0].loss = None  # type: ignore[misc]


def test_a_part_with_nothing_to_train_stops_there_and_the_next_part_starts_from_its_model(tmp_path, monkeypatch):
    ran = recording_stages(monkeypatch)
    starts = []

    def select_nothing(part, settings):
        starts.append(part.model)
        ran.append((part.iteration, part.name, "select"))
        return EMPTY_SELECTION

    monkeypatch.setattr(stages, "select", select_nothing)
    recipe = make_recipe(tmp_path, "sft_dpo", iteration_times=1, on_empty_selection="carry_forward")
    run = build_run(recipe, {"train": TRAIN_ENV}, gpu=False)
    final = loop.run_loop(run)
    assert [name for _, part, name in ran if part == "sft"] == ["generate", "score", "select"]  # no train
    assert [name for _, part, name in ran if part == "dpo"] == ["probe", "search", "pairs", "train"]
    assert starts == [recipe.initial_model_path]
    assert final == str(run.paths.checkpoint(0))


def test_dry_run_names_the_loss_model_in_use(tmp_path):
    recipe = make_recipe(tmp_path, "sft", loss_model_path=str(tmp_path / "judge"))
    text = dry_run(recipe)
    assert f"LM loss ({tmp_path / 'judge'} on the run's vLLM loss server beside the policy)" in text
    assert rules.loss_model(recipe) == str(tmp_path / "judge")
    plain = make_recipe(tmp_path, "sft")
    rendered = dry_run(plain, gpu=None)
    assert f"LM loss ({plain.initial_model_path} on the run's vLLM loss server" in rendered


@pytest.mark.parametrize(("method", "part", "from_initial", "expected"), [
    ("sft", None, False, "current"), ("sft", None, True, "initial"),
    ("dpo", None, True, "initial"), ("sft_dpo", "sft", True, "initial"),
    ("sft_dpo", "dpo", True, "current"),  # DPO of iSFT-DPO continues from the iteration's SFT checkpoint
])  # fmt: skip
def test_train_start(tmp_path, method, part, from_initial, expected):
    recipe = make_recipe(tmp_path, method, from_initial=from_initial)
    start = rules.train_start(recipe, "current", part)
    assert start == (recipe.initial_model_path if expected == "initial" else "current")


def test_the_plan_shows_the_model_training_starts_from(tmp_path):
    recipe = make_recipe(tmp_path, "dpo", from_initial=True)
    text = dry_run(recipe)
    assert text.count(f"model: {recipe.initial_model_path}") >= 3  # both iterations' train stages, and serving
    assert f"reference: {recipe.initial_model_path}" in text


def test_derived_defaults(tmp_path):
    dpo = make_recipe(tmp_path, "dpo", explore_count=5)
    assert dpo.mcts_selections == 5  # iDPO: explore_count; iSFT-DPO: 8
    assert make_recipe(tmp_path, "sft_dpo", explore_count=5).mcts_selections == 8
    assert rules.vllm_loss_batch_size(dpo) == 4 * dpo.loss_batch_size == 32
    assert rules.workers(dpo) == dpo.thread_count and rules.workers(dpo, 3) == 3 and rules.workers(dpo, 0) == 1
    sweep = load_recipe(
        InferenceRecipe, None, {"dataset_type": "arc", "model_root_path": str(tmp_path / "ckpts")}, check_paths=False
    )
    assert sweep.output_dir == sweep.output_root_path  # an evaluation's vLLM cache and logs go under its output


def record(example, sample: int, status: str, tokens: int) -> dict:
    return {
        "task_id": example.id,
        "sample_index": sample,
        "example": example.to_dict(),
        "final_answer": "B",
        "parser_version": PARSER_VERSION,  # as parsed when written (an older version is re-parsed from the text)
        "status": status,
        "token_count": tokens,
        "utterances": [{"speaker": "Alice", "text": f"reply {sample}"}],
    }


@pytest.mark.parametrize("counts", [[(("ok", 50)), ("ok", 80), ("too_long", 300)], [("ok", 0), ("too_long", 120)]])
def test_the_t_max_written_is_the_one_the_reward_used(tmp_path, counts):
    recipe = make_recipe(tmp_path, "sft", cal_ppl=False, min_tokens=0)
    example = arc_examples(1)[0]
    records = [record(example, i, status, tokens) for i, (status, tokens) in enumerate(counts)]
    line = reward_question(records, [None] * len(records), recipe)
    from optima.reward import Conversation

    t_max = question_t_max([Conversation([], r["token_count"], 0.0, r["status"]) for r in records])
    assert line["t_max"] == t_max
    for result in line["results"]:
        if result["status"] == "ok" and result["token_count"] > 0:
            assert result["reward_parts"]["token_term"] == pytest.approx(
                recipe.lambda1 * result["token_count"] / t_max
            )
        else:
            assert result["reward_parts"]["token_term"] == recipe.overlong_penalty


def test_evaluation_recipes_warn_about_fields_they_ignore(tmp_path, caplog):
    values = {"dataset_type": "arc", "model_root_path": str(tmp_path), "temperature": 0.9, "explore_count": 3}
    with caplog.at_level("WARNING"):
        load_recipe(InferenceRecipe, None, values, check_paths=False)
    warned = [r.getMessage() for r in caplog.records]
    assert any("temperature=0.9 is not used by InferenceRecipe" in m for m in warned)
    assert any("explore_count=3 is not used by InferenceRecipe" in m for m in warned)
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_recipe(
            InferenceRecipe, None, {"dataset_type": "arc", "model_root_path": str(tmp_path)}, check_paths=False
        )
    assert not caplog.records


def test_the_score_stage_shares_one_math_verifier(tmp_path, monkeypatch):
    """Scoring MATH answers with the stage's verifier starts no verifier per conversation."""
    from optima.store import write_jsonl
    from optima.tasks import Example, scoring
    from optima.tasks.math_equiv import MathVerifier

    started = []

    class CountingVerifier(MathVerifier):
        def __init__(self, *args, **kwargs):
            started.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(scoring, "MathVerifier", CountingVerifier)
    example = Example(id="m0", task="math", question="Half of 1?", answer="\\frac{1}{2}", score_type="math")
    records = [record(example, i, "ok", 50 + i) | {"final_answer": answer} for i, answer in enumerate(["1/2", "0.5"])]
    write_jsonl(records, tmp_path / "generations.jsonl")
    recipe = make_recipe(tmp_path, "sft", cal_ppl=False, min_tokens=0)
    with MathVerifier() as shared:
        stats = reward_generations(
            recipe, tmp_path / "generations.jsonl", tmp_path / "rewarded.jsonl", RewardScorers(verifier=shared)
        )
    assert stats["accuracy"] == 1.0 and started == []
    reward_generations(recipe, tmp_path / "generations.jsonl", tmp_path / "again.jsonl")
    assert len(started) == 2  # without one, each answer starts its own
