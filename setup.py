"""moe-rl: GSPO/GRPO post-training of Qwen3-MoE on Megatron-Core (Ascend NPU, CUDA, or CPU for tests)."""

from setuptools import find_packages, setup

# torch is deliberately unpinned: the NPU stack needs torch 2.7.1 (with torch_npu), the CPU
# set-up in the README installs torch 2.13.0 first, and neither must be overridden here.
CORE = [
    "torch",
    "megatron-core==0.12.1",  # the version MindSpeed supports
    "ray[default]",
    "pyyaml",
    "transformers",
    "safetensors",
    "einops",
    "numpy",
    "tqdm",
    "psutil",  # megatron-core's dist_checkpointing (torch_dist save)
    "pyarrow",  # parquet datasets (verl's format)
    "matplotlib",  # the comparison report's plots (recipe.compare.report)
]

setup(
    name="moe-rl",
    version="0.1.0",
    description=__doc__,
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.12",
    packages=[*find_packages(include=["loss", "megatron_bridge", "megatron_bridge.*", "recipe", "recipe.*"]),
              "megatron_bridge.shipped_configs"],
    # configs/ ships inside the package, so an installed copy finds it from any directory
    # (megatron_bridge/configs.py); a source checkout reads it where it is
    package_dir={"megatron_bridge.shipped_configs": "configs"},
    package_data={"megatron_bridge.shipped_configs": ["*/*.yaml"]},
    install_requires=CORE,
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "filelock"],
        # MindSpeed is installed from its git source and vllm-ascend per its version table
        # (README, "Install on Ascend"); torch_npu must match torch 2.7.1.
        "npu": ["torch==2.7.1", "torch_npu==2.7.1"],
        "gpu": ["vllm"],
    },
)
