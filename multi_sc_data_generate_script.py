r"""Multi-agent self-consistency: k sampled conversations per eval question, then majority vote.

See docs/method.md#self-consistency.

    python multi_sc_data_generate_script.py --model_path runs/arc_sft/checkpoints/iteration_0 \
        --dataset_type arc --device 0 --port 8000 --num_thread 128 --output_path runs/arc_sft/sc \
        --temperature 0.5 --vllm_env .venvs/vllm

Add --dry-run to print what would run.
"""

from optima.cli.evaluate import run_eval_script
from optima.config import MultiSCRecipe


def main(argv: list[str] | None = None) -> int:
    return run_eval_script(MultiSCRecipe, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
