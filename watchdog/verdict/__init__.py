"""The verdict stage (``stage.py``): the one entry to a decision, live and offline."""

from .stage import decide, decide_facts, fill_words

__all__ = ["decide", "decide_facts", "fill_words"]
