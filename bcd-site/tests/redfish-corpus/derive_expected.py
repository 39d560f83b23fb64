#!/usr/bin/env python3
"""Writes <tree>/expected.json: the inventory a correct client must read from the tree, derived from the JSON files
alone (never from our client's output), by the rules docs/site.md states: a component whose Status.State is Absent
is not one; a link listed twice is one; CPUs are processors typed CPU (or untyped), GPUs those typed GPU, else HPE
Chassis Devices typed GPU that list a PCI function of class 3 or 0x12 (or of unknown class; a device typed GPU
with no PCI function, such as an HGX baseboard, is not a GPU); PCIe devices are the system's PCIeDevices and its
chassis' collections, else HPE PCIDevices that are not empty slots (class 0xff); drives come from Storage, else the
chassis' Links.Drives, else SimpleStorage; a captured error body ({"error": …}) is no resource; when the Processors or Memory collection cannot be read, the summaries
count. Review the output before committing it: it is the test's oracle. Usage: derive_expected.py TREE..."""
import json
import os
import sys


def main(tree):
    def get(oid):
        p = os.path.join(tree, oid.split("?")[0].rstrip("/")[len("/redfish/v1"):].lstrip("/"), "index.json")
        try:
            with open(p) as f:
                doc = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        # A capture of an error answer (Intel's tree holds some) is no resource.
        return None if isinstance(doc.get("error"), dict) and "@odata.id" not in doc else doc

    def norm(p):
        return p.rstrip("/")

    def members(oid):
        c = get(oid)
        if c is None:
            return None
        out, seen = [], set()
        for m in c.get("Members") or []:
            if norm(m["@odata.id"]) not in seen:
                seen.add(norm(m["@odata.id"]))
                out.append(m["@odata.id"])
        return out

    def absent(d):
        return ((d or {}).get("Status") or {}).get("State") == "Absent"

    root = get("/redfish/v1")
    exp = {"managers": 0, "chassis": 0, "systems": []}
    if "Managers" in root:
        exp["managers"] = len([m for m in members(root["Managers"]["@odata.id"]) or [] if get(m) is not None])
    chassis = {}
    if "Chassis" in root:
        for m in members(root["Chassis"]["@odata.id"]) or []:
            d = get(m)
            if d is not None:
                chassis[norm(m)] = d
        exp["chassis"] = len(chassis)
    for sp in (members(root["Systems"]["@odata.id"]) or []) if "Systems" in root else []:
        s = get(sp)
        if s is None:
            continue
        e = {"path": sp, "id": s.get("Id"), "manufacturer": s.get("Manufacturer"), "model": s.get("Model"),
             "serial": s.get("SerialNumber"), "uuid": s.get("UUID"), "power": s.get("PowerState")}
        procs = members(s["Processors"]["@odata.id"]) if "Processors" in s else None
        if procs is None:
            e["cpus"] = (s.get("ProcessorSummary") or {}).get("Count", 0)
            gpus = []
        else:
            ps = [get(p) for p in procs]
            ps = [p for p in ps if p is not None and not absent(p)]
            e["cpus"] = len([p for p in ps if p.get("ProcessorType") in (None, "CPU")])
            gpus = [p.get("Model") for p in ps if p.get("ProcessorType") == "GPU"]
        mem = members(s["Memory"]["@odata.id"]) if "Memory" in s else None
        if mem is None:
            e["memory_mib"] = round((s.get("MemorySummary") or {}).get("TotalSystemMemoryGiB", 0) * 1024)
            e["memory_modules"] = None
        else:
            ms = [get(m) for m in mem]
            ms = [m for m in ms if m is not None and not absent(m)]
            e["memory_modules"] = len(ms)
            e["memory_mib"] = sum(m.get("CapacityMiB") or 0 for m in ms)
        sys_chassis = [chassis.get(norm(c["@odata.id"])) or get(c["@odata.id"])
                       for c in (s.get("Links") or {}).get("Chassis") or []]
        sys_chassis = [c for c in sys_chassis if c is not None]
        drive_links, storage_ok = [], False
        if "Storage" in s and members(s["Storage"]["@odata.id"]) is not None:
            storage_ok = True
            for st in members(s["Storage"]["@odata.id"]):
                drive_links += [d["@odata.id"] for d in (get(st) or {}).get("Drives") or []]
        if not storage_ok or not drive_links:
            for c in sys_chassis:
                drive_links += [d["@odata.id"] for d in (c.get("Links") or {}).get("Drives") or []]
                if "Drives" in c:
                    drive_links += members(c["Drives"]["@odata.id"]) or []
        seen, drives = set(), 0
        for d in drive_links:
            if norm(d) in seen:
                continue
            seen.add(norm(d))
            x = get(d)
            if x is not None and not absent(x):
                drives += 1
        if drives == 0 and "SimpleStorage" in s:
            for ss in members(s["SimpleStorage"]["@odata.id"]) or []:
                drives += len([d for d in (get(ss) or {}).get("Devices") or [] if not absent(d)])
        e["drives"] = drives
        nics, macs = 0, []
        if "EthernetInterfaces" in s:
            for n in members(s["EthernetInterfaces"]["@odata.id"]) or []:
                x = get(n)
                if x is None or absent(x):
                    continue
                typ = x.get("EthernetInterfaceType")
                vlan = (typ == "Virtual" and (x.get("VLAN") or {}).get("VLANEnable")) or "vlan" in (x.get("Id") or "").lower() \
                    or "vlan" in (x.get("Name") or "").lower()
                host = ((x.get("Links") or {}).get("HostInterface") is not None) or typ == "Virtual" \
                    or "host interface" in (x.get("Name") or "").lower()
                if vlan or host:
                    continue
                nics += 1
                mac = x.get("MACAddress") or ""
                parts = mac.replace("-", ":").split(":")
                if len(parts) == 6 and all(len(p) == 2 and all(ch in "0123456789abcdefABCDEF" for ch in p) for p in parts) \
                        and any(p != "00" for p in parts):
                    macs.append(mac)
        e["nics"], e["macs"] = nics, macs
        pcie, seen = [], set()
        for l in s.get("PCIeDevices") or [] if isinstance(s.get("PCIeDevices"), list) else []:
            if norm(l["@odata.id"]) not in seen:
                seen.add(norm(l["@odata.id"]))
                pcie.append(l["@odata.id"])
        for c in sys_chassis:
            if "PCIeDevices" in c:
                for m in members(c["PCIeDevices"]["@odata.id"]) or []:
                    if norm(m) not in seen:
                        seen.add(norm(m))
                        pcie.append(m)
        pcie_n = len([p for p in pcie if get(p) is not None and not absent(get(p))])
        hpe = ((s.get("Oem") or {}).get("Hpe") or {}).get("Links") or {}
        classes = {}
        if "PCIDevices" in hpe:
            for m in members(hpe["PCIDevices"]["@odata.id"]) or []:
                d = get(m)
                if d is None:
                    continue
                classes[norm(m)] = d.get("ClassCode")
                if pcie_n == 0 and not pcie and d.get("ClassCode") != 255:
                    pcie_n += 0  # counted below
            if pcie_n == 0:
                pcie_n = len([c for c in classes.values() if c != 255])
        if not gpus:
            for c in sys_chassis:
                dl = (((c.get("Oem") or {}).get("Hpe") or {}).get("Links") or {}).get("Devices")
                if not dl:
                    continue
                for m in members(dl["@odata.id"]) or []:
                    d = get(m)
                    if d is None or d.get("DeviceType") != "GPU" or absent(d):
                        continue
                    inst = d.get("DeviceInstances") or []
                    cl = [classes.get(norm(i["@odata.id"]), "unknown") for i in inst]
                    cl = [x for x in cl if x != "unknown"]
                    if inst and (not cl or any(x in (3, 18, None) for x in cl)):
                        gpus.append(d.get("Name"))
        e["pcie_devices"] = pcie_n
        e["gpus"] = len(gpus)
        e["gpu_models"] = sorted(set(g for g in gpus if g))
        exp["systems"].append(e)
    with open(os.path.join(tree, "expected.json"), "w") as f:
        json.dump(exp, f, indent=1, sort_keys=True)
        f.write("\n")
    print(tree, json.dumps({k: v for k, v in exp.items() if k != "systems"}),
          [(e["id"], e["cpus"], e["gpus"], e["memory_modules"], e["memory_mib"], e["drives"], e["nics"], e["pcie_devices"]) for e in exp["systems"]])


for t in sys.argv[1:]:
    main(t)
