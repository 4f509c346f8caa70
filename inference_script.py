r"""Checkpoint sweep: evaluate every iteration_<k> checkpoint greedily on the eval split.

See docs/method.md#checkpoint-sweep.

    python inference_script.py --model_root_path runs/arc_sft/checkpoints --dataset_type arc \
        --device 0 --port 8000 --num_thread 128 --output_root_path runs/arc_sft/eval --vllm_env .venvs/vllm

Each checkpoint is served with vLLM, answers the first N eval questions (1000 for the information-exchange
tasks, the whole test split for debate tasks, or --limit), and its conversations go to <output>/<ckpt>.jsonl.
Add --dry-run to print what would run.
"""

from optima.cli.evaluate import run_eval_script
from optima.config import InferenceRecipe


def main(argv: list[str] | None = None) -> int:
    return run_eval_script(InferenceRecipe, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
