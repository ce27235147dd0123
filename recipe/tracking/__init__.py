"""What a run reports: the step's metrics under verl's names (``metrics``) and where they go:
console, ``metrics.jsonl``, TensorBoard, SwanLab, Weights & Biases (``loggers``), and the tables and
figures of metric series that reports are made of (``figures``)."""
