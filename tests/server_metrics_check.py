"""Parses a /metrics body with prometheus_client's text parser and checks the families named.

usage: server_metrics_check.py METRICS_FILE FAMILY...
Exits 1 naming what failed: a parse error, or a family missing. Prints "family value" for each
sample of the families asked, one a line.
"""
import sys

from prometheus_client.parser import text_string_to_metric_families


def main():
    text = open(sys.argv[1], encoding="utf-8").read()
    try:
        families = {f.name: f for f in text_string_to_metric_families(text)}
    except Exception as e:  # the parser raises ValueError and others on malformed text
        print(f"parse error: {e}")
        return 1
    missing = [name for name in sys.argv[2:] if name not in families]
    if missing:
        print("missing: " + " ".join(missing))
        return 1
    for name in sys.argv[2:]:
        for s in families[name].samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            print(f"{s.name}{{{labels}}} {s.value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
