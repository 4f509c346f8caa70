"""A driver process for the kill/interrupt tests: ``python tests/generation_driver.py CONFIG.json``.

It does what the pipeline does for one generation stage, serve -> generate, and prints ``READY <urls>`` once the
endpoints answer. CONFIG keys: ``output_dir``, ``out`` (JSONL), ``examples`` (count of ``arc_examples``),
``samples``, ``recipe`` (overrides), and either ``model`` + ``vllm_env`` (``"fake"`` or a path; launches
servers) or recipe ``endpoints``. ``cpu_replicas`` defaults to 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from optima.agents.conversation import GenerationSettings
from optima.agents.generation import generate_conversations  # noqa: E402
from optima.environments import PythonEnv, resolve_env  # noqa: E402
from optima.logging_utils import setup_logging  # noqa: E402
from optima.paths import RunPaths  # noqa: E402
from optima.serving.vllm_server import serve  # noqa: E402
from tests.helpers import arc_examples, build_test_recipe  # noqa: E402

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


def main() -> int:
    config = json.loads(Path(sys.argv[1]).read_text())
    setup_logging()
    recipe = build_test_recipe(Path(config["output_dir"]), **config.get("recipe", {}))
    env_spec = config.get("vllm_env")
    env = PythonEnv("fake", "python", (sys.executable, str(FAKE_VLLM))) if env_spec == "fake" else None
    if env_spec not in (None, "fake"):
        env = resolve_env(env_spec, "vllm")
    stage = RunPaths.from_recipe(recipe).stage(0)
    with serve(recipe, config.get("model", "model"), env, stage, config.get("cpu_replicas", 1)) as urls:
        print("READY", json.dumps(urls), flush=True)
        generation = GenerationSettings(iteration=0, temperature=0.7, samples=config["samples"])
        generate_conversations(recipe, arc_examples(config["examples"]), urls, Path(config["out"]), generation)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
