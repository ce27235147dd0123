"""The data: verl-format prompt files, tokenised and drawn in a seeded, resumable order
(``dataset``), and the built-in tasks with their tiny models that ``builtin:tiny`` and
``builtin:tiny_long`` stand for (``tiny_task``)."""
