"""The agents: prompts, the chat renderer and the format pool; the two-agent turn loop builds on these.

See docs/method.md#conversations.
"""
