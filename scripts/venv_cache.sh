# Sourced by scripts/setup.sh: the two virtualenvs cached by content, so that a second checkout on the same machine
# (a fresh CI clone, a copied run directory's repo) gets them in seconds instead of reinstalling ~6 GB.
#
# An entry is a virtualenv as setup.sh built it, hard-linked (no data copied), under
# $GLM_LORA_VENV_CACHE (default $XDG_CACHE_HOME or ~/.cache, then glm-lora/venvs; "off" or empty: no cache; no
# cache either without a home directory), named by what decides its
# content: the kind, setup.sh's stamp (pyproject.toml's hash / the vLLM and torch pins), the Python that made it and
# these two scripts. Restoring hard-links the entry into the checkout and rewrites the few files that name the
# checkout's path (console scripts' shebangs, pyvenv.cfg, the editable install's finder); those are written anew, so
# the entry and the checkout that made it never change. Entries appear by an atomic rename (a concurrent setup that
# built the same one keeps the first); the two newest of each kind are kept, and those less than a day old. Where
# the cache is on another filesystem (no hard links), nothing is cached and setup installs as before.
# Needs: REPO (the checkout), PY (the Python that makes the virtualenvs).

_cache_home="${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}"
VENV_CACHE="${GLM_LORA_VENV_CACHE-${_cache_home:+$_cache_home/glm-lora/venvs}}"
[ "$VENV_CACHE" = off ] && VENV_CACHE=""
unset _cache_home

venv_key() {   # KIND STAMP -> the entry's name
  local made_by
  made_by=$("$PY" -c 'import os, sys; print(sys.version, os.path.realpath(sys.executable))')
  printf '%s\n' "$1" "$2" "$made_by" "$(cat "$REPO/scripts/setup.sh" "$REPO/scripts/venv_cache.sh" | sha256sum)" |
    sha256sum | cut -c1-16 | sed "s/^/$1-/"
}

venv_restore() {   # ENTRY DIR -> 0 if DIR (relative to REPO) now holds the entry, 1 if there is none to restore
  local src="$VENV_CACHE/$1" tmp="$REPO/$2.restoring.$$" origin
  [ -n "$VENV_CACHE" ] && [ -f "$src/.glm-lora-origin" ] || return 1
  rm -rf "$tmp"
  if ! cp -al "$src" "$tmp" 2>/dev/null; then rm -rf "$tmp"; return 1; fi
  origin=$(cat "$src/.glm-lora-origin")
  rm -f "$tmp/.glm-lora-origin"
  # Files naming the checkout that built the entry: rewritten (a new file each, so the entry's stays as it is)
  "$PY" - "$origin" "$REPO" "$tmp" <<'EOF' || { rm -rf "$tmp"; return 1; }
import glob, os, sys
old, new, venv = sys.argv[1:]
files = [os.path.join(venv, "pyvenv.cfg"), *glob.glob(os.path.join(venv, "bin", "*"))]
for site in glob.glob(os.path.join(venv, "lib", "python*", "site-packages")):
    files += glob.glob(os.path.join(site, "*.pth")) + glob.glob(os.path.join(site, "__editable__*.py"))
    files += glob.glob(os.path.join(site, "*.dist-info", "direct_url.json"))
for f in files:
    if os.path.islink(f) or not os.path.isfile(f):
        continue
    with open(f, "rb") as fh:
        data = fh.read()
    if old.encode() in data:
        with open(f + ".tmp", "wb") as fh:
            fh.write(data.replace(old.encode(), new.encode()))
        os.chmod(f + ".tmp", os.stat(f).st_mode)
        os.replace(f + ".tmp", f)
EOF
  rm -rf "${REPO:?}/$2"
  mv -T "$tmp" "$REPO/$2" || { rm -rf "$tmp"; return 1; }
}

venv_save() {   # ENTRY DIR: DIR (relative to REPO), just built, becomes the entry unless it exists already
  local tmp kind="${1%-*}"
  [ -n "$VENV_CACHE" ] && [ ! -e "$VENV_CACHE/$1" ] || return 0
  mkdir -p "$VENV_CACHE" && tmp=$(mktemp -d "$VENV_CACHE/.saving.XXXXXX") || return 0
  rmdir "$tmp"
  if ! cp -al "$REPO/$2" "$tmp" 2>/dev/null; then rm -rf "$tmp"; return 0; fi
  rm -f "$tmp/.glm-lora-stamp"
  printf '%s\n' "$REPO" > "$tmp/.glm-lora-origin"     # a file of the entry's own, not linked to the checkout's
  mv -T "$tmp" "$VENV_CACHE/$1" 2>/dev/null || rm -rf "$tmp"
  # the two newest entries of this kind stay, and any made in the last day: another checkout may be restoring one
  # (an `if`, not `[ ] && rm`: a loop whose last test fails would fail the caller under `set -e -o pipefail`)
  ls -dt "$VENV_CACHE/$kind"-* 2>/dev/null | tail -n +3 | while read -r old; do
    if [ -n "$(find "$old" -maxdepth 0 -mmin +1440)" ]; then rm -rf "$old"; fi
  done
  return 0
}
