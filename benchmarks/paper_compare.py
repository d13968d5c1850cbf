"""The paper's reported communication speedups of SparDL (Section VI: 14 workers on Ethernet
"with default setting", 5 on InfiniBand) against our projection of the same ratios at its P
and model sizes. The paper gives no link rate, so 1 GbE and 10 GbE are both shown.
Run from the repository root: `python -m benchmarks.paper_compare` (prints a Markdown
table)."""

import functools
import json
import os

import spardl_jax as sj
from benchmarks import project

DENSITY = 0.01
# The H200's sync compute per rank that the VGG-16 projection uses (scripts/scale_project.sh:
# P = 16, n = 14.7M), in ms, scaled here by each case's n.
PROJECTION = os.path.join(os.path.dirname(__file__), "results", "scale", "vgg16",
                          "projection.json")


@functools.cache
def _vgg16() -> dict:
  with open(PROJECTION) as f:
    return json.load(f)["args"]


# (case, P, links, n: the paper's parameter count, {baseline: SparDL's speedup it reports}).
CASES = [
    ("VGG-19 / CIFAR-100", 14, ("1gbe", "10gbe"), 20.1e6,
     {"topkdsa": 6.4, "topka": 5.1, "oktopk": 1.6}),
    ("VGG-11 / House", 14, ("1gbe", "10gbe"), 9.2e6,
     {"topkdsa": 5.6, "topka": 4.7, "oktopk": 2.2}),
    ("LSTM-IMDB", 14, ("1gbe", "10gbe"), 35.2e6, {"topkdsa": 2.7, "topka": 3.8, "oktopk": 1.8}),
    ("LSTM-PTB", 14, ("1gbe", "10gbe"), 66e6, {"topkdsa": 5.0, "topka": 4.5, "oktopk": 2.3}),
    ("ResNet-50 / ImageNet", 14, ("1gbe", "10gbe"), 25.6e6, {"oktopk": 2.3}),
    ("BERT-base / Wikipedia", 14, ("1gbe", "10gbe"), 133.5e6, {"oktopk": 2.0}),
    ("VGG-19 / CIFAR-100, RDMA", 5, ("ib100",), 20.1e6,
     {"topkdsa": 4.0, "topka": 3.4, "oktopk": 3.0}),
    ("BERT-base, RDMA", 5, ("ib100",), 133.5e6, {"oktopk": 4.2}),
]


def speedup(baseline: str, *, p: int, n: int, link: str, with_compute: bool) -> float:
  def seconds(name: str) -> float:
    # Each method's compute at the case's P (the nearest measured P's figure below it),
    # scaled from VGG-16's n.
    compute = (project.compute_at(_vgg16()["compute"], name, p)[0] / 1e3 * n / _vgg16()["n"]
               if with_compute else 0.0)
    return project.sync_seconds(sj.methods.make(name, density=DENSITY), p=p, n=n,
                                link=project.LINKS[link], compute_s=compute)
  return seconds(baseline) / seconds("spardl")


def main(argv=None) -> int:
  del argv  # no options
  links = ("1gbe", "10gbe", "ib100")
  print("SparDL's speedup in communication: the paper's, then ours as communication only / "
        "with the H200's measured compute\n")
  print("| case | P | over | paper | " + " | ".join(links) + " |")
  print("| --- | --- | --- | --- |" + " --- |" * len(links))
  for case, p, case_links, n, reported in CASES:
    for baseline, paper in reported.items():
      cells = [" / ".join(f"{speedup(baseline, p=p, n=int(n), link=link, with_compute=c):.1f}×"
                          for c in (False, True)) if link in case_links else ""
               for link in links]
      print(f"| {case} | {p} | {baseline} | {paper}× | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
