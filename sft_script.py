r"""iSFT: iterative supervised fine-tuning on the best conversations (docs/method.md#isft).

Each iteration serves the current model with vLLM, lets Alice and Bob solve training questions together,
scores every conversation (task score, token cost, readability), selects training data and fine-tunes with
TRL; the next iteration starts from the new checkpoint. Re-running the same command resumes.

    python sft_script.py --train_config_path train/sft_recipes/arc.yaml --vllm_env .venvs/vllm \
        --alignment_env .venvs/train

    python sft_script.py --train_config_path train/sft_recipes/demo_arc.yaml --dry-run   # print the plan

Environments (--vllm_env, --alignment_env) are virtualenv folders, python executables or conda env names;
they default to the project's .venvs/vllm and .venvs/train (`make setup`).
"""

from optima.cli import run_loop_script
from optima.config import SFTRecipe


def main(argv: list[str] | None = None) -> int:
    return run_loop_script(SFTRecipe, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
