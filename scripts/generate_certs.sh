#!/usr/bin/env bash
# Generate the TLS certificates (and optionally SuperNode authentication keys) for a
# Flower deployment. Needs only `openssl` (and `ssh-keygen` for --supernode-keys).
#
# Usage:
#   scripts/generate_certs.sh [OUT_DIR] [--san DNS:host.example.org] [--san IP:10.0.0.5] ...
#                             [--supernode-keys N] [--days 365] [--rsa-bits 2048] [--force]
#
# Writes into OUT_DIR (default: deploy/certs):
#   ca.key, ca.crt            a self-signed certificate authority (keep ca.key private);
#                             ca.crt is what SuperNodes (--root-certificates) and the
#                             `flwr` CLI (root-certificates in $FLWR_HOME/config.toml) trust.
#   server.key, server.crt    the SuperLink's key and certificate, signed by the CA
#                             (flower-superlink --ssl-certfile/--ssl-keyfile/--ssl-ca-certfile).
#                             Subject alternative names: DNS:localhost, IP:127.0.0.1 and
#                             every --san given, e.g. the SuperLink host's name and address
#                             when SuperNodes on other machines connect to it.
#   keys/supernode_<i>, keys/supernode_<i>.pub (with --supernode-keys N, i = 0..N-1)
#                             ECDSA P-384 key pairs in OpenSSH format for SuperNode
#                             authentication: the private key stays on the SuperNode
#                             (--auth-supernode-private-key), the public key is registered
#                             with `flwr supernode register <key>.pub <connection>`.
#
# Existing files are kept unless --force is given (a new CA invalidates every deployed
# ca.crt). Connect with exactly the names in the SANs: a SuperNode that dials
# `127.0.0.1:PORT` needs IP:127.0.0.1, one that dials `superlink.lan:PORT` needs
# DNS:superlink.lan.
set -euo pipefail

out_dir="deploy/certs"
days=365
rsa_bits=2048
num_keys=0
force=0
sans=("DNS:localhost" "IP:127.0.0.1")

while [[ $# -gt 0 ]]; do
    case "$1" in
        --san) sans+=("$2"); shift 2 ;;
        --san=*) sans+=("${1#--san=}"); shift ;;
        --days) days="$2"; shift 2 ;;
        --rsa-bits) rsa_bits="$2"; shift 2 ;;
        --supernode-keys) num_keys="$2"; shift 2 ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "generate_certs.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) out_dir="$1"; shift ;;
    esac
done

for san in "${sans[@]}"; do
    if [[ ! "$san" =~ ^(DNS|IP):[^,[:space:]]+$ ]]; then
        echo "generate_certs.sh: --san must look like DNS:name or IP:address, got '$san'" >&2
        exit 2
    fi
done

command -v openssl >/dev/null || { echo "generate_certs.sh: openssl not found" >&2; exit 1; }
mkdir -p "$out_dir"
umask 077  # private keys readable by the owner only

if [[ $force -eq 1 || ! -f "$out_dir/ca.crt" || ! -f "$out_dir/server.crt" \
      || ! -f "$out_dir/server.key" || ! -f "$out_dir/ca.key" ]]; then
    san_line=$(IFS=,; echo "${sans[*]}")
    cfg="$out_dir/server.cnf"
    cat > "$cfg" <<EOF
[req]
distinguished_name = dn
prompt = no
req_extensions = v3_req

[dn]
CN = flower-superlink

[v3_req]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = $san_line
EOF
    # Certificate authority.
    openssl genrsa -out "$out_dir/ca.key" "$rsa_bits" 2>/dev/null
    openssl req -x509 -new -key "$out_dir/ca.key" -sha256 -days "$days" \
        -subj "/CN=fedfm-flower local CA" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$out_dir/ca.crt"
    # SuperLink server key, signing request and certificate (with the SANs).
    openssl genrsa -out "$out_dir/server.key" "$rsa_bits" 2>/dev/null
    openssl req -new -key "$out_dir/server.key" -config "$cfg" -out "$out_dir/server.csr"
    openssl x509 -req -in "$out_dir/server.csr" -CA "$out_dir/ca.crt" -CAkey "$out_dir/ca.key" \
        -CAcreateserial -days "$days" -sha256 -extfile "$cfg" -extensions v3_req \
        -out "$out_dir/server.crt" 2>/dev/null
    rm -f "$out_dir/server.csr" "$out_dir/ca.srl" "$cfg"
    chmod 644 "$out_dir/ca.crt" "$out_dir/server.crt"
    openssl verify -CAfile "$out_dir/ca.crt" "$out_dir/server.crt" >/dev/null
    echo "TLS: $out_dir/{ca.crt,server.crt,server.key} (SANs: $san_line)"
else
    echo "TLS: keeping the existing certificates in $out_dir (use --force to replace them)"
fi

if [[ "$num_keys" -gt 0 ]]; then
    command -v ssh-keygen >/dev/null || { echo "generate_certs.sh: ssh-keygen not found" >&2; exit 1; }
    mkdir -p "$out_dir/keys"
    for ((i = 0; i < num_keys; i++)); do
        key="$out_dir/keys/supernode_$i"
        if [[ $force -eq 1 || ! -f "$key" ]]; then
            rm -f "$key" "$key.pub"
            ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode_$i" -f "$key"
        fi
    done
    echo "SuperNode keys: $out_dir/keys/supernode_{0..$((num_keys - 1))}{,.pub} (ECDSA P-384)"
fi
