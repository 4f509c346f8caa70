"""Optima's own trainer arguments, parsed beside TRL's by ``TrlParser`` from the handbook-style YAML.

TRL 1.x dropped two DPO settings the method relies on (docs/method.md#dpo-and-rpo): ``max_prompt_length`` (prompt
truncation before the completion) and ``rpo_alpha`` (the NLL term on chosen that makes iDPO an RPO). They live here and
the DPO script maps them onto what the installed TRL supports. Pure dataclasses: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFLIGHT_HELP = "one optimizer step on synthetic rows at the length limits, saving nothing (the run's preflight)"


@dataclass
class OptimaSFTArguments:
    """Extra SFT settings.

    Parameters:
        mask_partner_turns (`bool`, defaults to `True`): Loss only on the trained agent's own utterances.
        preflight (`bool`, defaults to `False`): One step on synthetic rows of `max_length`; save nothing.
    """

    mask_partner_turns: bool = field(default=True, metadata={"help": "loss only on the agent's own turns"})
    preflight: bool = field(default=False, metadata={"help": PREFLIGHT_HELP})


@dataclass
class OptimaDPOArguments:
    """Extra DPO settings.

    Parameters:
        max_prompt_length (`int`, *optional*): Prompt tokens kept (from the end) before the completion; must be
            smaller than `max_length`.
        rpo_alpha (`float`, *optional*): Weight of the NLL term on the chosen completion (iDPO: 1.0).
        preflight (`bool`, defaults to `False`): One step on synthetic pairs at the length limits; save nothing.
    """

    max_prompt_length: int | None = field(default=None, metadata={"help": "prompt tokens kept (< max_length)"})
    rpo_alpha: float | None = field(default=None, metadata={"help": "weight of NLL on chosen; null = plain DPO"})
    preflight: bool = field(default=False, metadata={"help": PREFLIGHT_HELP})
