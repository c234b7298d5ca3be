#!/bin/sh
# Create .venv if needed and install chunkledger with the given extras at the versions pinned in
# requirements.lock (the tested versions, whatever PyPI serves today). Called by the Makefile:
#   sh tools/install.sh pipeline            # what `make demo` needs
#   sh tools/install.sh pipeline,gcs,...    # what `make test` / `make bench` need
# A stamp in .venv records the extras installed for this pyproject.toml + lock; a request they cover
# installs nothing.
set -eu
extras="$1"
venv="${VENV:-.venv}"
python="${PYTHON:-python3.11}"
pip_version=26.3
hash=$(cat pyproject.toml requirements.lock | cksum | cut -d' ' -f1)
stamp="$venv/.installed-$hash"
have=""
[ -f "$stamp" ] && have=$(cat "$stamp")
missing=$(printf '%s\n' "$extras" | tr ',' '\n' | grep -v '^$' | while read -r e; do
  printf '%s\n' "$have" | grep -qxF "$e" || echo "$e"; done)
[ -z "$missing" ] && exit 0
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
want=$( (printf '%s\n' "$have"; printf '%s\n' "$extras" | tr ',' '\n') | grep -v '^$' | sort -u)
"$venv/bin/python" -m pip install -q "pip==$pip_version"
"$venv/bin/python" -m pip install -c requirements.lock -e ".[$(printf '%s' "$want" | paste -sd, -)]"
rm -f "$venv"/.installed-*
printf '%s\n' "$want" > "$stamp"
