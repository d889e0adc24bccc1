"""Build the optional Cython data path in ``ltp_ext/``.

Everything in ``ltp_ext`` has a pure-Python twin (``_<name>_py.py``), so the
package works when no C compiler is available: a failed extension build prints
a warning and the twins are used. Set ``LTP_REQUIRE_EXTENSIONS=1`` to turn that
warning into an error (CI does), and ``LTP_NO_EXTENSIONS=1`` at run time to
force the twins even when the extensions are built.
"""

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _required() -> bool:
    return os.environ.get("LTP_REQUIRE_EXTENSIONS", "") not in ("", "0")


class OptionalBuildExt(build_ext):
    """``build_ext`` that degrades to the pure-Python twins on failure."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # pragma: no cover - depends on the machine
            if _required():
                raise
            print(f"WARNING: ltp_ext not built ({exc}); using the pure-Python twins", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # pragma: no cover - depends on the machine
            if _required():
                raise
            print(f"WARNING: {ext.name} not built ({exc}); its pure-Python twin is used", file=sys.stderr)


def _extensions():
    sources = sorted(glob.glob(os.path.join("ltp_ext", "*.pyx")))
    if not sources:
        return []
    try:
        import numpy
        from Cython.Build import cythonize
    except ImportError as exc:  # pragma: no cover
        if _required():
            raise
        print(f"WARNING: Cython/numpy missing ({exc}); using the pure-Python twins", file=sys.stderr)
        return []
    exts = [
        Extension(
            "ltp_ext." + os.path.splitext(os.path.basename(src))[0],
            [src],
            include_dirs=[numpy.get_include()],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=["-O3"],
        )
        for src in sources
    ]
    return cythonize(
        exts,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
