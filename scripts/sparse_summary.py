#!/usr/bin/env python3
"""Prints the tables of docs/sparse.md from the JSON files of scripts/sparse_measure.sh."""
import glob
import json
import os
import sys

out = sys.argv[1] if len(sys.argv) > 1 else 'sparse-results'


def load(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


print('| book | tokens | p | mean budget | mean recall | recall q10 | fixed top-k (est.) | '
      'oracle top-k | Quest | estimator rms (logits) | rms x sqrt(D) |')
print('|---|---|---|---|---|---|---|---|---|---|---|')
for path in sorted(glob.glob(os.path.join(out, 'audit_*.json')),
                   key=lambda p: (os.path.basename(p).split('_')[1], int(os.path.basename(p).split('_')[2]), p)):
    a = load(path)
    book = os.path.basename(path).split('_')[1]
    b = a['baselines_at_equal_budget']
    print(f"| {book} | {a['tokens']} | {a['p']:g} | {a['budget']['mean']:.3f} | "
          f"{a['recall']['mean']:.3f} | {a['recall']['q10']:.3f} | "
          f"{b['topk_estimated']['recall']:.3f} | {b['topk_oracle']['recall']:.3f} | "
          f"{b['quest']['recall']:.3f} (budget {b['quest']['budget']:.3f}) | "
          f"{a['estimator']['rms']:.2f} | {a['estimator']['normalized_rms_sqrt_d']:.3f} |")

print()
print('| kv | sparse p | decode steps | mean KL (decode steps) | max KL | top-1 | top-5 | mean budget |')
print('|---|---|---|---|---|---|---|---|')
for path in sorted(glob.glob(os.path.join(out, 'tf_*.json'))):
    t = load(path)
    name = os.path.basename(path)[3:-5].split('_')
    budget = t['sparse']['mean_budget'] if 'sparse' in t else 1.0
    print(f"| {name[0]} | {name[1]} | {t['metered_steps']} | {t['decode_mean_kl']:.3g} | "
          f"{t['decode_max_kl']:.3g} | {t['decode_top1']:.3f} | {t['decode_top5']:.3f} | {budget:.3f} |")

print()
for name in ('needle_dense', 'needle_sparse'):
    path = os.path.join(out, name + '.json')
    if os.path.exists(path):
        n = load(path)
        rows = ', '.join(f"{r['length']}: {r['accuracy']:.2f}" for r in n['lengths'])
        print(f"{name}: {rows}")
