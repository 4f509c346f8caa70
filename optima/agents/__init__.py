"""The agents: prompts, the chat renderer and the format pool; the two-agent turn loop builds on these.

See docs/method.md#conversations.
"""

from optima import lazy_exports

# Public names, imported on first use (the conversation loop pulls in the serving client).
_EXPORTS = {
    "ConversationRunner": "runner",
    "GenerationHooks": "generation",
    "GenerationSettings": "runner",
    "generate_conversations": "generation",
    "generation_settings": "runner",
    "Utterance": "prompts",
    "render_utterance": "prompts",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
