"""Package discovery: every package under batchjob/, and kernels/ installed as batchjob.kernels (a top-level
`kernels` would collide with another distribution of that name). A new folder needs no edit here."""
from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["batchjob", "batchjob.*"]),
                "batchjob.kernels", *(f"batchjob.kernels.{p}" for p in find_packages("kernels"))])
