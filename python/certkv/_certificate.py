"""The certificate dict of a sequence's (or a store's) attention, from the C API's meter and KV
statistics: built in one place for certkv.Session, certkv.KvStore and the transformers cache."""

from __future__ import annotations

from typing import Any, Mapping


def certificate(scheme: str, meter: Mapping[str, Any], kv: Mapping[str, Any]) -> dict[str, Any]:
    """scheme, metered; for a lossy scheme the tier, tau, coverage at tau, the meter's max and
    quantiles over the (layer, query head, step) cells; the KV bytes by storage class."""
    cert: dict[str, Any] = {"scheme": scheme, "metered": meter["metered"]}
    if meter["metered"]:
        cert.update(tier=meter["tier"], certified=meter["certified"], tau=meter["tau"],
                    delta_loc=meter["delta_loc"], coverage=meter["coverage"], meter_max=meter["max"],
                    meter_p50=meter["p50"], meter_p99=meter["p99"], cells=meter["cells"],
                    overflow=meter["overflow"], gate_repairs=meter["gate_repairs"],
                    pagein_bytes=meter["pagein_bytes"],
                    exact_fallback_blocks=meter["exact_fallback_blocks"])
        if meter["tier"] == "B":
            cert["note"] = "Tier B is valid for non-adaptive queries (teacher-forced text)"
    cert.update(kv_bytes_by_class=kv["page_bytes_by_class"], kv_bytes=kv["kv_bytes"],
                kv_bytes_bf16=kv["kv_bytes_bf16"], kv_tokens=kv["n_tokens"])
    return cert
