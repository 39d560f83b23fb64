#!/usr/bin/env python3
"""Copies the part of a Redfish mockup tree (one index.json per resource path) that an inventory and the power and
boot actions read: the service root, sessions, systems, managers, chassis and the collections below them that hold
components. Everything else (schemas, registries, logs, BIOS attribute registries, accounts) is left out to keep the
corpus small. Usage: prune.py SRC_TREE DEST_TREE. Files are copied byte for byte; nothing is edited."""
import json
import os
import re
import shutil
import sys

KEEP = [
    r"",
    r"SessionService", r"SessionService/Sessions",
    r"(Systems|Managers|Chassis)",
    r"(Systems|Managers|Chassis)/[^/]+",
    r"Systems/[^/]+/(Processors|Memory|Storage|SimpleStorage|EthernetInterfaces|PCIeDevices|PCIDevices|ResetActionInfo)",
    r"Systems/[^/]+/(Processors|Memory|Storage|SimpleStorage|EthernetInterfaces|PCIeDevices|PCIDevices)/[^/]+",
    r"Systems/[^/]+/Storage/[^/]+/Drives(/[^/]+)?",
    r"Chassis/[^/]+/(PCIeDevices|Devices|Drives)(/[^/]+)?",
    r"Managers/[^/]+/ResetActionInfo",
]
KEEP = [re.compile(f"^{k}$") for k in KEEP]


def main(src, dest):
    n = 0
    # Members of the top collections are kept wherever they live (Intel nests chassis: Chassis/RackMount/Baseboard).
    extra = set()
    for top in ("Systems", "Managers", "Chassis"):
        try:
            with open(os.path.join(src, top, "index.json")) as f:
                for m in json.load(f).get("Members") or []:
                    extra.add(m["@odata.id"].rstrip("/")[len("/redfish/v1/"):])
        except FileNotFoundError:
            pass
    for root, _dirs, files in os.walk(src):
        if "index.json" not in files:
            continue
        rel = os.path.relpath(root, src)
        rel = "" if rel == "." else rel
        if rel not in extra and not any(k.match(rel) for k in KEEP):
            continue
        size = os.path.getsize(os.path.join(root, "index.json"))
        if size >= 4 << 20:
            sys.exit(f"{rel}/index.json is {size} bytes: over the corpus limit")
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        shutil.copyfile(os.path.join(root, "index.json"), os.path.join(dest, rel, "index.json"))
        n += 1
    print(f"{dest}: {n} files")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
