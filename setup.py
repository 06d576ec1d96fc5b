"""Packaging for elastor_ds: elastic, partition-agnostic checkpointing for DeepSpeed/Megatron-core."""
from setuptools import find_packages, setup

setup(
    name="elastor_ds",
    version="0.1.0",
    description="Elastic model partitioning and partition-agnostic async checkpointing "
    "for DeepSpeed and Megatron-core",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["elastor_ds", "elastor_ds.*"]),
    install_requires=[
        "torch>=2.3",
        "safetensors>=0.4",
        "numpy>=1.24",
        "tqdm>=4.60",
        "PyYAML>=6.0",
        "zlib-ng>=1.0",   # SIMD CRC32 for every checkpoint byte (checkpoint.crc): the default install is the fast one
        "cryptography>=42",   # GMAC of peer-copied snapshot files (checkpoint.auth.FileMac): ~10x HMAC-SHA256's speed
    ],
    extras_require={
        "deepspeed": ["deepspeed>=0.16"],
        "megatron": ["megatron-core>=0.16", "psutil>=5.9"],
        "planner": ["scipy>=1.10"],
        "elastic": ["matplotlib>=3.7"],   # `elastor run`'s timeline plot (the table needs nothing)
        "fast": [],                       # kept for old install lines: zlib-ng is now a plain dependency
    },
    entry_points={"console_scripts": ["elastor=elastor_ds.cli:console_main"]},
)
