"""A fake ``vllm serve`` for the ``VLLMServer`` tests: ``python tests/fake_vllm.py [anything] --port P ...``.

Reads ``--port`` from its arguments (everything else is ignored, so it accepts the real command line) and
behaves as ``FAKE_VLLM_MODE`` says:

* ``serve`` (default): after ``FAKE_VLLM_STARTUP_S`` seconds, serve the scripted OpenAI API of
  ``tests.fake_openai`` (replies delayed by ``FAKE_VLLM_DELAY_S``); with ``FAKE_VLLM_CHILD=1`` it first starts a
  child process (like vLLM's engine core) in its process group;
* ``crash``: print a marker line (and ``FAKE_VLLM_REASON`` as vLLM logs a refusal) and exit with code 3 before
  listening;
* ``hang``: never listen;
* ``stubborn``: like ``serve``, but ignore SIGTERM (teardown must escalate to SIGKILL).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fake_openai import FakeOpenAIServer, FakeReply, agreeing_reply  # noqa: E402

CRASH_MARKER = "fake vllm: scripted crash (CUDA out of memory)"


def main() -> None:
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    mode = os.environ.get("FAKE_VLLM_MODE", "serve")
    print(f"fake vllm: mode={mode} port={port} argv={argv}", flush=True)
    if mode == "crash":
        print(CRASH_MARKER, flush=True)
        if os.environ.get("FAKE_VLLM_REASON"):  # what vLLM logs when it refuses to start: the cause, then a wrapper
            print(f"(EngineCore pid=7) ERROR {os.environ['FAKE_VLLM_REASON']}", flush=True)
            print("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
        raise SystemExit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAKE_VLLM_CHILD") == "1":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(float(os.environ.get("FAKE_VLLM_STARTUP_S", "0")))
    if mode == "hang":
        threading.Event().wait()
    delay = float(os.environ.get("FAKE_VLLM_DELAY_S", "0"))

    def respond(body: dict) -> FakeReply:
        reply = agreeing_reply(body)
        reply.delay_s = delay
        return reply

    FakeOpenAIServer(respond, port=port).start()
    print("fake vllm: ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
