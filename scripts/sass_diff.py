#!/usr/bin/env python3
"""Kernel by kernel, the machine code of two builds (or two object files): which kernels are the same
instruction for instruction, which differ, and by how much in the instructions that matter to a GEMM (tensor
core, barriers, shared and local memory, global stores, TMA). A kernel change that must leave other kernels
alone (a build option off, a refactoring) is checked with it before it costs a GPU run.

  sass_diff.py A B            A, B: build directories (their src/kernels objects) or .o / .so / .cubin files
  sass_diff.py A B --only fp8_gemm,grouped_gemm_nt   only the objects whose name contains one of these
  sass_diff.py A B --show NAME  the first differing instructions of the kernels whose name contains NAME

Needs cuobjdump on PATH (the CUDA toolkit's; on a machine without it, the nvidia-cuda-cuobjdump wheel has it).
Instruction addresses and encodings are dropped, so a kernel that only moved inside the binary is the same.
"""
import argparse
import collections
import difflib
import pathlib
import re
import shutil
import subprocess
import sys

FUNCTION = re.compile(r"^\s*Function : (\S+)")
# An instruction line: "/*0a40*/  @!P0 HGMMA.64x256x16.F32.BF16 gdesc[UR4], ... ;  /* 0x... */"
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
# The counted opcodes: a name, and the pattern of an instruction's opcode (predicate removed) it counts.
COUNTED = (
    ("wgmma", re.compile(r"^[HQ]GMMA\b")),
    ("wgmma waits", re.compile(r"^WARPGROUP\.DEPBAR\b")),
    ("barriers", re.compile(r"^(BAR|BAR\.\w+)\b")),
    ("mbarrier", re.compile(r"^SYNCS\.")),
    ("local memory", re.compile(r"^(LDL|STL)\b")),
    ("shared loads", re.compile(r"^(LDS|LDSM)\b")),
    ("shared stores", re.compile(r"^(STS|STSM)\b")),
    ("global stores", re.compile(r"^(STG|RED|ATOMG)\b")),
    ("TMA", re.compile(r"^UTMA")),
)
OBJECT_SUFFIXES = (".o", ".so", ".cubin")
RESOURCE_FUNCTION = re.compile(r"^\s*Function (\S+?):?\s*$")
RESOURCE = re.compile(r"(\w+):(\d+)")
RESOURCE_KEYS = ("REG", "STACK", "SHARED", "LOCAL")


def opcode(instruction):
    """The instruction's opcode with its modifiers, its predicate (@P0, @!UP1) removed."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def parse_sass(text):
    """{kernel name: [instruction, ...]} from cuobjdump --dump-sass output (addresses and encodings dropped).
    A name seen twice (the same kernel in two objects of a library) keeps its first listing."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = None if m.group(1) in kernels else m.group(1)
            if current is not None:
                kernels[current] = []
            continue
        if current is None:
            continue
        m = INSTRUCTION.match(line)
        if m:
            kernels[current].append(m.group(1))
    return kernels


def parse_resources(text):
    """{kernel name: {"REG": n, "STACK": n, "SHARED": n, "LOCAL": n}} from cuobjdump --dump-resource-usage."""
    out, current = {}, None
    for line in text.splitlines():
        m = RESOURCE_FUNCTION.match(line)
        if m:
            current = m.group(1)
            continue
        if current is not None and "REG:" in line:
            out.setdefault(current, {k: int(v) for k, v in RESOURCE.findall(line) if k in RESOURCE_KEYS})
            current = None
    return out


def counts(instructions):
    """{counted name: number} over one kernel's instructions."""
    out = collections.Counter()
    for ins in instructions:
        op = opcode(ins)
        for name, pattern in COUNTED:
            if pattern.match(op):
                out[name] += 1
    return out


def compare(a, b):
    """(same, differ, only_a, only_b): kernel names; differ holds (name, instructions a, instructions b)."""
    same, differ = [], []
    for name in sorted(set(a) & set(b)):
        if a[name] == b[name]:
            same.append(name)
        else:
            differ.append((name, a[name], b[name]))
    return same, differ, sorted(set(a) - set(b)), sorted(set(b) - set(a))


def first_differences(ia, ib, limit=12):
    """The first `limit` lines of a unified diff of two instruction lists."""
    lines = list(difflib.unified_diff(ia, ib, "a", "b", n=1, lineterm=""))
    return lines[2:2 + limit]


def objects(path, only):
    """{object name: file} under a build directory (the library's kernel objects), or the file itself."""
    p = pathlib.Path(path)
    if p.is_file():
        return {p.name: p}
    found = {}
    for f in sorted(p.glob("CMakeFiles/megamoe.dir/src/kernels/*.o")):
        found[f.name] = f
    if not found:
        for f in sorted(p.iterdir()):
            if f.suffix in OBJECT_SUFFIXES:
                found[f.name] = f
    if only:
        found = {k: v for k, v in found.items() if any(o in k for o in only)}
    return found


def dump(path):
    """cuobjdump's SASS of one file, parsed, and each kernel's resources; an object without device code gives
    no kernels."""
    listings = []
    for what in ("--dump-sass", "--dump-resource-usage"):
        run = subprocess.run(["cuobjdump", what, str(path)], capture_output=True, text=True)
        if run.returncode != 0 and "does not contain device code" not in run.stderr:
            sys.exit(f"sass_diff: cuobjdump failed on {path}: {run.stderr.strip()}")
        listings.append(run.stdout)
    return parse_sass(listings[0]), parse_resources(listings[1])


def demangle(names):
    """Readable kernel names (c++filt where present): the template and its arguments, without the return type,
    the parameter list and the project's namespaces."""
    readable = list(names)
    if names and shutil.which("c++filt"):
        run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if run.returncode == 0 and len(run.stdout.splitlines()) == len(names):
            readable = run.stdout.splitlines()
    short = []
    for r in readable:
        r = re.sub(r"^void ", "", r)
        cut = r.find(">(")
        r = r[:cut + 1] if cut >= 0 else r
        short.append(re.sub(r"megamoe::(kernels|device)::", "", r))
    return short


def report(a_kernels, b_kernels, show=None, out=sys.stdout, b_resources=None):
    """Prints the comparison; returns the number of kernels that differ or are in one side only. Kernels of B
    that use local memory (its instructions, or stack or local bytes in b_resources) are named."""
    same, differ, only_a, only_b = compare(a_kernels, b_kernels)
    print(f"same instruction for instruction: {len(same)}; differ: {len(differ)}; "
          f"only in A: {len(only_a)}; only in B: {len(only_b)}", file=out)
    for (name, ia, ib), readable in zip(differ, demangle([d[0] for d in differ])):
        ca, cb = counts(ia), counts(ib)
        changed = [f"{k} {ca[k]}->{cb[k]}" for k, _ in COUNTED if ca[k] != cb[k]]
        print(f"  differs: {readable}", file=out)
        print(f"    instructions {len(ia)} -> {len(ib)}; " + (", ".join(changed) if changed else
                                                            "counted opcodes unchanged"), file=out)
        if show and (show in name or show in readable):
            for line in first_differences(ia, ib):
                print(f"      {line}", file=out)
    for label, names in (("only in A", only_a), ("only in B", only_b)):
        for readable in demangle(names):
            print(f"  {label}: {readable}", file=out)
    resources = b_resources or {}
    for name in sorted(b_kernels):
        r = resources.get(name, {})
        if counts(b_kernels[name])["local memory"] or r.get("STACK", 0) or r.get("LOCAL", 0):
            print(f"  B uses local memory: {demangle([name])[0]} (stack {r.get('STACK', '?')} B, "
                  f"local {r.get('LOCAL', '?')} B)", file=out)
    return len(differ) + len(only_a) + len(only_b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--only", default="", help="comma-separated parts of object names")
    ap.add_argument("--show", default=None, help="print the first differences of kernels whose name has this")
    args = ap.parse_args(argv)
    if not shutil.which("cuobjdump"):
        sys.exit("sass_diff: cuobjdump is not on PATH")
    only = [o for o in args.only.split(",") if o]
    oa, ob = objects(args.a, only), objects(args.b, only)
    if not oa or not ob:
        sys.exit(f"sass_diff: no objects in {args.a if not oa else args.b}")
    if pathlib.Path(args.a).is_file() and pathlib.Path(args.b).is_file():
        (fa,), (fb,) = oa.values(), ob.values()
        pairs = [(f"{fa.name} / {fb.name}", fa, fb)]
    else:
        pairs = [(name, oa[name], ob[name]) for name in sorted(set(oa) & set(ob))]
        for name in sorted(set(oa) ^ set(ob)):
            print(f"{name}: in one build only")
    total = 0
    for name, fa, fb in pairs:
        print(f"== {name}")
        (ka, _), (kb, rb) = dump(fa), dump(fb)
        total += report(ka, kb, args.show, b_resources=rb)
    print(f"kernels that differ or are in one side only: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
