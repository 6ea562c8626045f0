"""Checks, at load, of the internal names of dependencies that cactus-edge relies on: where a
dependency offers no public way to do something, we use its internals, pin the tested version
range in pyproject.toml, and refuse with one line, instead of failing later in an odd place, when
an installed version lacks them."""

from __future__ import annotations

from importlib import metadata

from .errors import IncompatibleDependencyError

# package → the version the internals were tested with (pyproject.toml pins the range around it)
TESTED = {"uvicorn": "0.55.0", "llama-cpp-python": "0.3.36"}


def installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


def require_names(owner: object, names: tuple[str, ...], package: str, what: str) -> None:
    """Raise IncompatibleDependencyError unless ``owner`` (a module or class of ``package``) has
    every one of ``names``; ``what`` says what uses them."""
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise incompatible(package, f"lacks {', '.join(missing)}", what)


def incompatible(package: str, problem: str, what: str) -> IncompatibleDependencyError:
    tested = TESTED[package]
    return IncompatibleDependencyError(
        f"{package} {installed_version(package)} {problem}, which {what} uses "
        f"(tested with {tested}); install {package}=={tested}"
    )
