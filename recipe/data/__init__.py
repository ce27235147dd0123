"""The data: verl-format prompt files, tokenised and drawn in a seeded, resumable order
(``dataset``), and the built-in tasks with their tiny models that ``builtin:tiny``,
``builtin:tiny_long`` and ``builtin:tiny_long_tail`` stand for (``tiny_task``)."""
