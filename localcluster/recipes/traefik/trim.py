"""Leaves out lego's DNS providers from Traefik, in a writable copy of Traefik's module.

    python3 trim.py <copy of github.com/traefik/traefik/v3>

Traefik's ACME resolver names a DNS-01 provider by string (`certificatesResolvers.<name>.acme.dnsChallenge.provider`)
and so links lego's registry of every provider (`github.com/go-acme/lego/v4/providers/dns`): ~190 DNS services'
clients and SDKs (AWS, Azure, Google, Alibaba, Huawei, Tencent, Yandex, ...), about a sixth of Traefik's packages
and the largest part of its build, the second longest of a cold `.ci/run`. The local cluster's Traefik routes the
operator's HTTPRoutes and never asks a certificate authority for anything, so this build answers a DNS challenge
with an error naming why; the HTTP-01 and TLS-ALPN-01 challenges, and all the rest of Traefik, are unchanged.
"""
from __future__ import annotations

import sys
from pathlib import Path

IMPORT = '\t"github.com/go-acme/lego/v4/providers/dns"\n'
CALL = "dns.NewDNSChallengeProviderByName(p.DNSChallenge.Provider)"
INSTEAD = ('nil, errors.New("this Traefik is built without lego\'s DNS providers (embedops\' local cluster, '
           'localcluster/recipes/traefik/trim.py): use the HTTP or TLS challenge")')


def trim(module: Path) -> None:
    acme = module / "pkg" / "provider" / "acme" / "provider.go"
    text = acme.read_text()
    if text.count(IMPORT) != 1 or text.count(CALL) != 1 or '\t"errors"\n' not in text:
        raise SystemExit(f"trim.py: {acme} is not the code this script knows (Traefik v3.6.12)")
    acme.write_text(text.replace(IMPORT, "").replace(CALL, INSTEAD))


if __name__ == "__main__":
    trim(Path(sys.argv[1]))
    print("lego's DNS providers left out")
