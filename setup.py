"""Build hook: ship the TLA+ modules of ``tla/`` inside the wheel (``omni_async/verify/tla``).

setuptools' package data cannot reach outside ``src/``, and ``tla/`` stays at the top
of the repository, next to ``spec/``.  Everything else is in ``pyproject.toml``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithTla(build_py):
    def run(self) -> None:
        super().run()
        src = Path(__file__).resolve().parent / "tla"
        dst = Path(self.build_lib) / "omni_async" / "verify" / "tla"
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            if path.is_file() and path.suffix in {".tla", ".cfg", ".md"} and rel.parts[0] != "states":
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dst / rel)


setup(cmdclass={"build_py": BuildPyWithTla})
