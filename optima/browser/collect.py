"""What a run or an evaluation wrote, read into the plain views the conversation browser shows.

A run folder's stage folders hold the sampled conversations, their rewards, selection's verdicts (SFT), the token
probe and the search trees with their pairs (DPO); an evaluation folder one `<model>[.<method>].jsonl` per model
and method. Nothing here decides anything: kept or dropped and the rule come from what selection recorded, and a
pair's texts are read from its tree with the functions that mined it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from optima.evaluation.metrics import RecordScorer
from optima.evaluation.runs import load_results
from optima.evaluation.tables import LABELS
from optima.lineage import lineage_folders
from optima.paths import StagePaths, checkpoint_label
from optima.reward import finite_losses, is_cut
from optima.selection.dpo import best_and_worst, children_by_parent, path_utterances
from optima.store import group_by_question, load_records
from optima.tasks.math_equiv import MathVerifier
from optima.tasks.scoring import reparsed

NOT_RECORDED = "dropped (rule not recorded)"


@dataclass(frozen=True)
class Turn:
    """One utterance: who spoke, what, its tokens and LM loss when known."""

    speaker: str
    text: str
    tokens: int | None = None
    loss: float | None = None


@dataclass
class ConversationView:
    """One conversation (or rollout) with everything that decided its fate."""

    label: str
    turns: list[Turn]
    final_answer: str
    status: str
    stop_reason: str
    tokens: int
    cut: bool
    task_score: float | None = None
    lm_loss: float | None = None
    parts: dict[str, float] | None = None
    kept: bool | None = None  # None: not subject to a keep decision (rollouts, probes, evaluations)
    rule: str = ""

    @property
    def answered(self) -> bool:
        return bool(self.final_answer)


@dataclass
class PairView:
    """One DPO pair: the shared prefix up to the branch, the chosen and the rejected next utterance."""

    node_id: int
    depth: int
    prefix: list[Turn]
    chosen: Turn
    rejected: Turn
    chosen_value: float
    rejected_value: float
    kept: bool
    rule: str


@dataclass
class QuestionView:
    """One question: its text, the gold answer, what selection said, its conversations and pairs."""

    task_id: str
    question: str
    gold: str
    verdict: str = ""
    conversations: list[ConversationView] = field(default_factory=list)
    pairs: list[PairView] = field(default_factory=list)


@dataclass
class Section:
    """One stage output (or one evaluation file): a title, where it came from, its questions."""

    anchor: str
    title: str
    source: str
    questions: list[QuestionView]
    iteration: int | None = None  # the run's iteration (None for an evaluation file)
    tag: str = ""  # what the stage output is, for trackers: sampled, probe or search (sft/ or dpo/ in iSFT-DPO)
    left_out: int = 0  # questions not shown (the page's size limit)


def gold_text(record: dict) -> str:
    """The gold answer of a record's question: aliases joined; a multiple-choice answer with its option label."""
    example = record.get("example") or {}
    answer = example.get("answer", record.get("answer", ""))
    if isinstance(answer, list):
        return " | ".join(answer)
    options = [(label, text) for label, text in example.get("options") or () if answer in (label, text)]
    return f"{options[0][0]}) {options[0][1]}" if len(options) == 1 else str(answer)


def turns_of(record: dict) -> list[Turn]:
    """The utterances of a conversation record, rollout or tree path, with tokens and LM losses when recorded."""
    utterances = record["utterances"]
    tokens = record.get("tokens") or [u.get("tokens") for u in utterances]  # rollouts keep a list beside
    losses = record.get("losses") or [None] * len(utterances)
    return [Turn(u["speaker"], u["text"], n, loss) for u, n, loss in zip(utterances, tokens, losses, strict=False)]


def conversation_view(record: dict, label: str, verdict: tuple[bool | None, str] = (None, ""), score=None):
    """A `ConversationView` of one record (`score`: the task score when the record has no reward parts)."""
    turns = turns_of(record)
    losses = finite_losses(t.loss for t in turns)
    parts = record.get("reward_parts")
    return ConversationView(
        label=label,
        turns=turns,
        final_answer=record.get("final_answer") or "",
        status=record.get("status", ""),
        stop_reason=record.get("stop_reason") or "",
        tokens=record.get("token_count", 0),
        cut=is_cut(record),
        task_score=parts["task_score"] if parts else score,
        lm_loss=sum(losses) / len(losses) if losses else None,
        parts=parts,
        kept=verdict[0],
        rule=verdict[1],
    )


def question_view(record: dict) -> QuestionView:
    """The question a record is about (id, text, gold answer)."""
    text = record.get("question") or record["example"]["question"]
    return QuestionView(str(record["task_id"]), text, gold_text(record))


def sft_verdict(record: dict, decision: dict | None) -> tuple[bool | None, str]:
    """Kept or dropped, and the rule, of one conversation from its question's selection line (None: not selected)."""
    if decision is None:
        return None, ""
    if record["sample_index"] == decision.get("sample_index"):
        return bool(decision["kept"]), decision["reason"]
    return False, (decision.get("dropped") or {}).get(str(record["sample_index"]), NOT_RECORDED)


def question_verdict(decision: dict | None) -> str:
    """One line: what selection decided for the question's best conversation."""
    if decision is None:
        return ""
    if decision.get("sample_index") is None:
        return decision["reason"]
    rank = f", rank {decision['rank'] + 1}" if decision.get("rank") is not None else ""
    return f"best #{decision['sample_index']}: {decision['reason']}{rank}"


def plain_questions(records: Sequence[dict], score=None) -> list[QuestionView]:
    """Conversation records grouped by question, nothing kept or dropped (``score``: record -> task score)."""
    questions = []
    for group in group_by_question(records):
        question = question_view(group[0])
        question.conversations = [
            conversation_view(r, f"#{r['sample_index']}", score=score(r) if score else None) for r in group
        ]
        questions.append(question)
    return questions


def sampled_questions(sp: StagePaths) -> list[QuestionView]:
    """The sampled conversations of an SFT stage, rewarded and selected as far as it got (questions not yet
    scored follow as generated)."""
    rewarded, _ = load_records(sp.rewarded)
    decisions = {str(d["task_id"]): d for d in load_records(sp.selection_record)[0]}
    questions = []
    for line in rewarded:
        question = question_view(line["results"][0])
        decision = decisions.get(question.task_id)
        question.verdict = question_verdict(decision)
        question.conversations = [
            conversation_view(r, f"#{r['sample_index']}", sft_verdict(r, decision)) for r in line["results"]
        ]
        questions.append(question)
    scored = {q.task_id for q in questions}
    unscored = [reparsed(r) for r in load_records(sp.generations)[0] if str(r["task_id"]) not in scored]
    return questions + plain_questions(unscored)


def probe_questions(sp: StagePaths) -> list[QuestionView]:
    """The token probe's conversations (they set `T_max`; nothing is kept or dropped)."""
    return plain_questions(load_records(sp.probe)[0])


def pair_view(entry: dict, by_id: dict, children: dict) -> PairView:
    """A recorded pair with its texts read from the tree (`children`: `children_by_parent`, once per tree)."""
    node = by_id[entry["node_id"]]
    chosen, rejected = best_and_worst(children[node["id"]])
    return PairView(
        node_id=node["id"],
        depth=node["depth"],
        prefix=[Turn(u.speaker, u.text) for u in path_utterances(node, by_id)],
        chosen=Turn(chosen["speaker"], chosen["text"], chosen["tokens"]),
        rejected=Turn(rejected["speaker"], rejected["text"], rejected["tokens"]),
        chosen_value=entry["chosen_value"],
        rejected_value=entry["rejected_value"],
        kept=bool(entry["kept"]),
        rule=entry.get("reason") or ("kept" if entry["kept"] else NOT_RECORDED),
    )


def search_questions(sp: StagePaths) -> list[QuestionView]:
    """The search trees of a DPO stage: every rollout, and every pair found (kept or not, and why)."""
    records = {str(r["task_id"]): r for r in load_records(sp.selection_record)[0]}
    questions = []
    for line in load_records(sp.rollouts)[0]:
        question = question_view(line)
        record = records.get(question.task_id)
        question.conversations = [
            conversation_view(r, f"rollout {k} from node {r['start_node']}") for k, r in enumerate(line["rollouts"])
        ]
        by_id, children = {node["id"]: node for node in line["nodes"]}, children_by_parent(line["nodes"])
        question.pairs = [pair_view(entry, by_id, children) for entry in (record or {}).get("pairs", [])]
        if record is not None:
            kept = sum(p.kept for p in question.pairs)
            question.verdict = f"{len(question.pairs)} pairs found, {kept} kept"
        questions.append(question)
    return questions


def stage_folders(run_dir: Path) -> list[tuple[int, str, StagePaths]]:
    """`(iteration, part, folder)` of every stage folder with outputs of the current lineage, in run order."""
    return [
        (iteration, part, sp)
        for iteration, part, sp in lineage_folders(run_dir)
        if any(p.exists() for p in (sp.generations, sp.rewarded, sp.probe, sp.rollouts))
    ]


def run_sections(run_dir: Path) -> list[Section]:
    """Every stage output of a loop's run directory: sampled conversations, probes, trees and pairs."""
    kinds = (
        ("sampled", "sampled conversations (generate, score, select)", sampled_questions, ("generations", "rewarded")),
        ("probe", "token probe (sets T_max)", probe_questions, ("probe",)),
        ("search", "tree search rollouts and DPO pairs", search_questions, ("rollouts",)),
    )
    sections = []
    for iteration, part, sp in stage_folders(run_dir):
        where = sp.root.relative_to(run_dir).as_posix()
        head = f"Iteration {iteration + 1}" + (f" · {part.upper()} stage" if part else "")
        for kind, title, read, files in kinds:
            if any(getattr(sp, name).exists() for name in files):
                tag = f"{part}/{kind}" if part else kind
                sections.append(Section(_anchor(where, kind), f"{head} · {title}", where, read(sp), iteration, tag))
    return sections


def _anchor(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", "-".join(parts)).strip("-")


def method_of_file(path: Path) -> tuple[str, str]:
    """(method label, model label) of an evaluation file `<model>[.<method>].jsonl`."""
    labels = {"sc": LABELS["optima_sc"]} | LABELS
    model, _, method = path.stem.rpartition(".")
    if not model or method not in labels:
        model, method = path.stem, "optima"
    return labels[method], checkpoint_label(model)


def eval_sections(folder: Path) -> list[Section]:
    """One section per result file of an evaluation folder, each conversation with its task score."""
    sections = []
    with MathVerifier() as verifier:
        scorer = RecordScorer(verifier=verifier)
        for path in sorted(Path(folder).glob("*.jsonl")):
            records = load_results(path)  # the answers as the current parser reads them
            if not records or "utterances" not in records[0]:
                continue
            method, model = method_of_file(path)
            questions = plain_questions(records, scorer.score)
            sections.append(Section(_anchor(path.stem), f"{method} · {model}", path.name, questions))
    return sections


def collect_sections(folder: Path) -> list[Section]:
    """The sections of a loop's run directory, or of an evaluation folder when it has no iteration folders."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    return run_sections(folder) if stage_folders(folder) else eval_sections(folder)
