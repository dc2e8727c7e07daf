"""Structured output: a request's grammar (JSON schema, regex, choice, Lark/EBNF grammar) enforced on every token.

`params.py` (the user's `StructuredOutputsParams`) and `grammar.py` (conversion to the backend's grammar text and
its validation) load no torch, so the frontend checks a constraint before any engine work. `backend.py` is the
grammar-engine interface and `guidance.py` its llguidance implementation; the worker's logits processor
(`sample/structured_output.py`) keeps one matcher per sequence.
"""
