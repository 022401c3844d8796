"""`make gpu-wheels`: what a lent GPU machine lacks (infra/gpu/wheels.txt) as CPython 3.12 wheels in .whl/.

The machine (Python 3.12, torch 2.11 cu130, no network) gets the work tree and at most 64 MiB a call in all;
this checks that the wheels and the tree fit, and prints the command that installs them there. A pin that is
only published as a source archive (antlr4-python3-runtime 4.9.3, pure Python) is built into a wheel here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20  # what one device call carries: the work tree and the carried paths together
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64", "any"]
ON_DEVICE = ("python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
             "export PYTHONPATH=/tmp/site:infra/gpu/ray_stub")


def pins(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def download(pin: str, dest: Path) -> None:
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    binary = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
              "3.12", "--implementation", "cp", *platform_args, "-d", str(dest), pin]
    if subprocess.run(binary, capture_output=True, text=True).returncode == 0:
        return
    # no wheel for the device's Python: a pure-Python source archive builds into one that installs anywhere
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pin],
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"no cp312 wheel of {pin} and it does not build here:\n{built.stderr[-2000:]}")


def tree_bytes(repo: Path) -> int:
    """What a device call sends besides carried paths: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", type=Path, default=Path(__file__).with_name("wheels.txt"))
    parser.add_argument("--dest", type=Path, default=Path(".whl"))
    args = parser.parse_args()
    args.dest.mkdir(exist_ok=True)
    for stale in args.dest.glob("*.whl"):  # two versions of one package stop the whole install there
        stale.unlink()
    for pin in pins(args.list):
        download(pin, args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    carried, tree = sum(w.stat().st_size for w in wheels), tree_bytes(Path.cwd())
    print(f"{len(wheels)} wheels, {carried / 2**20:.1f} MiB; work tree {tree / 2**20:.1f} MiB; "
          f"limit {LIMIT / 2**20:.0f} MiB a call")
    if carried + tree > LIMIT:
        print(f"over the limit by {(carried + tree - LIMIT) / 2**20:.1f} MiB: carry fewer wheels per call")
        return 1
    print(f"on the device, with carry ['.whl']: {ON_DEVICE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
