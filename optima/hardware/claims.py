"""What a hardware allocation holds: each process's claim on each GPU, and the allocation (``HardwareAllocation``).

``optima.hardware.allocation`` places the servers and claims their shares; ``optima.hardware.training`` places the
trainer and claims its peak; both write into one ``HardwareAllocation``, which refuses an impossible allocation
(``check``) and renders it for ``--dry-run``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from optima.config import RecipeError
from optima.hardware.layout import ServerLayout
from optima.hardware.memory import gib
from optima.hardware.placement import TrainingPlacement
from optima.hardware.spec import Hardware


@dataclass(frozen=True)
class Claim:
    """One process's hold on a GPU: what (``loss server``), how much (bytes), and in which phases it holds it.

    ``generation``: while the policy samples; ``training``: while the trainer runs. A resident server holds its
    share in both.
    """

    what: str
    size: int
    generation: bool = True
    training: bool = False

    @property
    def resident(self) -> bool:
        """Held through both phases: a server that stays up (no trainer may share its GPU)."""
        return self.generation and self.training


def phase_total(claims: list[Claim], phase: str) -> int:
    """Bytes held on one GPU in ``phase`` (``generation`` or ``training``)."""
    return sum(c.size for c in claims if getattr(c, phase))


@dataclass
class HardwareAllocation:
    """Placements and claims of a run on some hardware (see the module docstring).

    Args:
        hardware: The machine(s).
        layout: Placements of the servers on node 0 (None: external endpoints).
        training: The training processes (None: an evaluation recipe).
        claims: ``(node, gpu id) -> claims`` on that GPU.
        lines: What ``render`` shows about each process.
        problems: Why the allocation cannot run (empty: it can).
        notes: Remarks that do not stop the run.
        loss_share: The loss server's memory share the allocation computed (None: the recipe's, or no loss server).
        accumulation: ``gradient_accumulation_steps`` per trainer (``sft``, ``dpo``) that keeps the released
            global batch on the planned processes, where it differs from the trainer YAML's
            (``optima.hardware.batch``).
        idle_for_batch: Free GPUs per node left idle to keep the released global batch (0: none).
    """

    hardware: Hardware
    layout: ServerLayout | None = None
    training: TrainingPlacement | None = None
    claims: dict[tuple[int, str], list[Claim]] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    loss_share: float | None = None
    accumulation: dict[str, int] = field(default_factory=dict)
    idle_for_batch: int = 0

    def claim(self, node: int, gpu: str, item: Claim) -> None:
        self.claims.setdefault((node, gpu), []).append(item)

    def check(self) -> None:
        """Raise every problem, numbered, as one ``RecipeError`` (nothing has started yet)."""
        if len(self.problems) == 1:
            raise RecipeError("hardware allocation", self.problems[0])
        if self.problems:
            listed = " ".join(f"({i}) {problem}" for i, problem in enumerate(self.problems, 1))
            raise RecipeError("hardware allocation", f"{len(self.problems)} problems: {listed}")

    def render(self) -> list[str]:
        """What ``--dry-run`` prints of it."""
        out = [f"  hardware: {self.hardware.describe()}", *(f"      {line}" for line in self.lines)]
        for (node, gpu), claims in sorted(self.claims.items()):
            gen = [c for c in claims if c.generation]
            train = [c for c in claims if c.training]
            text = f"generation {describe_claims(gen)}; training {describe_claims(train)}"
            out.append(f"      node {node} GPU {gpu}: {text}")
        out += [f"      note: {note}" for note in self.notes]
        out += [f"      REFUSED: {problem}" for problem in self.problems] or ["      plan: feasible"]
        return out


def describe_claims(claims: list[Claim]) -> str:
    if not claims:
        return "-"
    total = sum(c.size for c in claims)
    return f"{gib(total)} GiB (" + ", ".join(f"{c.what} {gib(c.size)}" for c in claims) + ")"
