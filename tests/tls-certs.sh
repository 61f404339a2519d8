#!/bin/sh
# tests/tls-certs.sh DIR -- the certificates for ltg's TLS tests.
#
# Creates in DIR (EC P-256 keys, SHA-256 signatures, PKCS#8 "PRIVATE KEY" PEM):
#   ca.pem, ca.key              a test CA ("ltg test CA")
#   localhost.pem, .key         a leaf for DNS:localhost, signed by the CA;
#                               the .pem is the chain: leaf first, then the CA
#   wrong.pem, wrong.key        a leaf for DNS:wrong.example, same CA
#   expired.pem, expired.key    a leaf for DNS:localhost, same CA, valid only
#                               in January 2020
#   other-ca.pem, other-ca.key  an unrelated CA, for "wrong CA" tests
# The leaves carry DNS names only, no IP address (BearSSL does not match IP
# SANs): connect to 127.0.0.1 and name the server "localhost".
#
# Quiet and idempotent: if every file is already there it does nothing;
# otherwise it makes a fresh set. Serve them with
#   tests/mock --port P --tls-cert DIR/localhost.pem --tls-key DIR/localhost.key
set -eu

if [ $# -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
if ! command -v openssl >/dev/null 2>&1; then
    echo "$0 needs the openssl command: run  sudo apt-get install openssl" >&2
    exit 1
fi

mkdir -p "$1"
DIR=$(cd "$1" && pwd)
FILES="ca.pem ca.key localhost.pem localhost.key wrong.pem wrong.key
       expired.pem expired.key other-ca.pem other-ca.key"
missing=0
for f in $FILES; do
    [ -s "$DIR/$f" ] || missing=1
done
[ "$missing" = 0 ] && exit 0

T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT INT TERM
export T

# Runs a command quietly; on failure shows what it said and stops.
run() {
    if ! "$@" >"$T/out" 2>&1; then
        echo "$0: failed: $*" >&2
        cat "$T/out" >&2
        exit 1
    fi
}

# One config for everything: "req" for the CAs and the requests, "ca" for
# signing (openssl ca, because openssl x509 -req cannot backdate in 3.0).
# LEAF_NAME picks the leaf's DNS name.
cat >"$T/openssl.cnf" <<'EOF'
[ req ]
distinguished_name = req_dn
prompt = no
[ req_dn ]
CN = unused
[ v3_ca ]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[ v3_leaf ]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyAgreement
extendedKeyUsage = serverAuth
subjectAltName = DNS:${ENV::LEAF_NAME}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[ ca ]
default_ca = test_ca
[ test_ca ]
database = ${ENV::T}/index.txt
new_certs_dir = ${ENV::T}
rand_serial = yes
unique_subject = no
default_md = sha256
policy = policy_any
[ policy_any ]
commonName = supplied
EOF
: >"$T/index.txt"
LEAF_NAME=localhost
export LEAF_NAME
CNF="$T/openssl.cnf"

key() {
    run openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 \
        -pkeyopt ec_param_enc:named_curve -out "$T/$1.key"
}

# ca NAME "CN"
ca() {
    key "$1"
    run openssl req -config "$CNF" -new -x509 -sha256 -days 3650 -key "$T/$1.key" \
        -subj "/CN=$2" -extensions v3_ca -out "$T/$1.pem"
}

# leaf NAME DNSNAME [openssl ca validity options...]
leaf() {
    name=$1 LEAF_NAME=$2
    shift 2
    key "$name"
    run openssl req -config "$CNF" -new -sha256 -key "$T/$name.key" \
        -subj "/CN=$LEAF_NAME" -out "$T/$name.csr"
    run openssl ca -config "$CNF" -batch -notext -cert "$T/ca.pem" -keyfile "$T/ca.key" \
        -extensions v3_leaf -in "$T/$name.csr" -out "$T/$name.leaf" "$@"
    cat "$T/$name.leaf" "$T/ca.pem" >"$T/$name.pem"
}

ca ca "ltg test CA"
ca other-ca "ltg other test CA"
leaf localhost localhost -days 3650
leaf wrong wrong.example -days 3650
leaf expired localhost -startdate 20200101000000Z -enddate 20200201000000Z

for f in $FILES; do
    mv "$T/$f" "$DIR/$f"
done
