"""Package layout of the libalign distribution (metadata lives in pyproject.toml).

The repository keeps the product's top-level folders; the wheel installs only align-named
import packages: ``libalign`` (the numerical core, from ``libalign/``), ``alignd`` (the
daemon and its tools, from ``services/alignd/``) and ``libalign.csrc`` (the kernel sources
of ``csrc/``, which ``libalign.kernels.native`` compiles on first use). ``alignclient`` is its own
distribution (``clients/``).
"""

from setuptools import find_namespace_packages, find_packages, setup

setup(
    packages=[
        *find_packages(".", include=["libalign", "libalign.*"]),
        # namespace discovery: data folders (the status page's static/) are packages too
        *find_namespace_packages("services", include=["alignd", "alignd.*"],
                                 exclude=["*.__pycache__"]),
        "libalign.csrc",
    ],
    package_dir={"alignd": "services/alignd", "libalign.csrc": "csrc"},
    package_data={"libalign.csrc": ["*.h", "*.cpp", "*.cu"],
                  "alignd": ["**/*.lua", "**/*.html", "**/*.js", "**/*.css"]},
)
