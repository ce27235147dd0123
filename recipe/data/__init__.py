"""The data: verl-format prompt files, tokenised and drawn in a seeded, resumable order
(``dataset``), and the built-in task with its tiny model that ``builtin:tiny`` stands for
(``tiny_task``)."""
