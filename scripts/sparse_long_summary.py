#!/usr/bin/env python3
"""Tables of docs/sparse.md, "Recall on long untiled contexts", from the JSON of
`certkv audit --sparse p=0.9 --rules ... --json` runs named sparse_audit_<model>_<book>_<tokens>_<topp>.json
(topp: `before`, Top-p with the boundary bucket ordered at 1/64 logit, or `after`, Top-p on quantized
logits at 1/256 logit).

  python3 scripts/sparse_long_summary.py docs/bench/sparse_audit_qwen*.json
"""
import json
import os
import sys


def name_parts(path):
    stem = os.path.basename(path)[:-len('.json')].split('_')
    return stem[3], int(stem[4]), stem[5]  # book, tokens, before/after


def rules_of(a):
    return {(r['p'], r['deviations']): r for r in a.get('rules', [])}


runs = {}
for path in sys.argv[1:]:
    with open(path) as f:
        runs[name_parts(path)] = json.load(f)

keys = sorted(runs, key=lambda k: (k[0], k[1], k[2] != 'before'))
shown = [(0.9, 0), (0.9, 1.0), (0.9, 1.5), (0.95, 0), (0.95, 1.0), (0.99, 0)]
print('| book | tokens | Top-p | cells | estimator rms | ' +
      ' | '.join(f'p {p:g}' + (f' + {z:g} dev.' if z else '') for p, z in shown) + ' |')
print('|---|---|---|---|---|' + '---|' * len(shown))
for k in keys:
    a = runs[k]
    r = rules_of(a)
    cells = ' | '.join(f"{r[s]['recall']:.3f} at {100 * r[s]['budget']:.1f}%" if s in r else '-' for s in shown)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {a['cells']} | {a['estimator']['rms']:.2f} | {cells} |")

print()
print('Rules with mean recall >= 0.90 at mean budget <= 10%:')
for k in keys:
    r = rules_of(runs[k])
    ok = sorted((v['budget'], p, z, v['recall']) for (p, z), v in r.items() if v['recall'] >= 0.9 and v['budget'] <= 0.1)
    print(f"  {k[0]} {k[1]} {k[2]}: " +
          (', '.join(f'p {p:g} + {z:g} dev. ({rc:.3f} at {100 * b:.1f}%)' for b, p, z, rc in ok) or 'none'))

for s in [(0.9, 0), (0.9, 1.5), (0.9, 1.0)]:
    print()
    print(f'Per layer, p {s[0]:g}' + (f' + {s[1]:g} deviations' if s[1] else '') + ': recall (budget %)')
    cols = [k for k in keys if s in rules_of(runs[k])]
    print('| layer | ' + ' | '.join(f'{k[0]} {k[1]} {k[2]}' for k in cols) + ' |')
    print('|---|' + '---|' * len(cols))
    layers = [l['layer'] for l in rules_of(runs[cols[0]])[s]['layers']] if cols else []
    for layer in layers:
        row = []
        for k in cols:
            l = next(x for x in rules_of(runs[k])[s]['layers'] if x['layer'] == layer)
            row.append(f"{l['recall']:.3f} ({100 * l['budget']:.1f})")
        print(f'| {layer} | ' + ' | '.join(row) + ' |')
