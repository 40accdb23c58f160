#!/usr/bin/env python3
"""Tables of the meter figures (docs/meter.md) from the JSON files of scripts/meter_measure.sh."""
import glob
import json
import os
import statistics
import sys

out = sys.argv[1]


def load(name):
    path = os.path.join(out, name)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    return json.load(open(path))


print('commit', open(os.path.join(out, 'commit.txt')).read().strip())
cap = load('capacity.json')
if cap:
    print('\n| scheme, head_dim (m) | bytes/token/head (K+V) | capacity vs bf16 | backing bytes/token |')
    print('|---|---|---|---|')
    for b in cap['benchmarks']:
        print('| %s | %.1f | %.3fx | %.0f |' % (b['label'], b['bytes_per_token_per_head'],
                                                b['capacity_vs_bf16'], b['backing_bytes_per_token']))

print('\n| scheme | tokens | cells | violations | coverage@0.2 | max TV | tightness q10 / q50 / q90 |')
print('|---|---|---|---|---|---|---|')
for n in (2048, 8192):
    for kv in ('fp8-e4m3', 'fp8-e5m2', 'fp8-e4m3-scaled', 'rtn8', 'rtn4', 'kivi2', 'dither8'):
        a = load('audit-%s-%d.json' % (kv, n))
        if a:
            t = a['tightness']
            print('| %s | %d | %d | %d | %.4f | %.3g | %.3g / %.3g / %.3g |' % (
                kv, n, a['cells'], a['violations'], a['coverage'], a['max_tv'], t['q10'], t['q50'], t['q90']))

print('\n| m | coverage@0.2 (austen-emma, calibration) | coverage@0.2 (melville, held apart) | violations |')
print('|---|---|---|---|')
for m in (0, 2, 4, 8, 16):
    a = load('coverage-m%d-austen-emma.json' % m)
    b = load('coverage-m%d-melville-moby-dick.json' % m)
    if a and b:
        print('| %d | %.5f | %.5f | %d |' % (m, a['coverage'], b['coverage'], a['violations'] + b['violations']))
print('\n| delta | coverage@0.2 (melville) | violations |')
print('|---|---|---|')
for d in ('1e-4', '1e-2', '5e-2'):
    a = load('coverage-delta%s.json' % d)
    if a:
        print('| %s | %.5f | %d |' % (d, a['coverage'], a['violations']))

print('\n| scheme | mean KL | p99 KL | max KL | top-1 | top-5 | meter coverage@0.2 (16 steps) |')
print('|---|---|---|---|---|---|---|')
for kv in ('fp8-e4m3', 'fp8-e5m2', 'fp8-e4m3-scaled', 'rtn8', 'rtn4', 'kivi2', 'dither8'):
    t = load('tf-%s.json' % kv)
    if t:
        print('| %s | %.2e | %.2e | %.2e | %.4f | %.4f | %.4f |' % (
            kv, t['mean_kl'], t['p99_kl'], t['max_kl'], t['top1'], t['top5'], t['meter']['coverage']))

print('\n| scheme | decode tok/s meter on (median of 3) | meter off | on / off |')
print('|---|---|---|---|')
for kv in ('dither8', 'rtn8'):
    on = [load('overhead-%s-on-%d.json' % (kv, r)) for r in (1, 2, 3)]
    off = [load('overhead-%s-off-%d.json' % (kv, r)) for r in (1, 2, 3)]
    if all(on) and all(off):
        a = statistics.median(x['decode_tok_per_s'] for x in on)
        b = statistics.median(x['decode_tok_per_s'] for x in off)
        ratios = [x['decode_tok_per_s'] / y['decode_tok_per_s'] for x, y in zip(on, off)]
        print('| %s | %.1f | %.1f | %.3f (per-run ratios %s) |' % (
            kv, a, b, a / b, ', '.join('%.3f' % r for r in ratios)))

rows = []
for path in sorted(glob.glob(os.path.join(out, 'needle-*.json'))):
    n = json.load(open(path))
    rows.append(n)
if rows:
    print('\n| kv | gate | ' + ' | '.join('%d' % l['length'] for l in rows[0]['lengths']) + ' | repairs | page-in MB |')
    print('|---|---|' + '---|' * len(rows[0]['lengths']) + '---|---|')
    for n in rows:
        rep = sum(l.get('repairs', 0) for l in n['lengths'])
        pin = sum(l.get('pagein_bytes', 0) for l in n['lengths']) / 1e6
        print('| %s | %s | %s | %d | %.1f |' % (n['kv'], 'yes' if n['gate'] else 'no',
              ' | '.join('%.2f' % l['accuracy'] for l in n['lengths']), rep, pin))
