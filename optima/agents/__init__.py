"""The agents: prompts, the chat renderer and the format pool (SPEC 2); the two-agent turn loop builds on these."""
