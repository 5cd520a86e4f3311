# Sourced by scripts/setup.sh and scripts/test.sh: Debian packages they need, installed when
# missing. As root (CI: a clean machine, no stdin) apt-get installs them without asking; as
# another user the caller is told which `sudo apt-get install` to run.

APT_INSTALLED=()  # what this run installed, for the summary
_apt_updated=""

# apt_need WHAT PACKAGE...: make sure the PACKAGEs are installed (WHAT says who needs them).
# Returns 1, having said what to run, when some are missing and we are not root.
apt_need() {
    local what=$1 pkg
    shift
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        echo "peerd: $what needs ${missing[*]}; run: sudo apt-get install ${missing[*]}" >&2
        return 1
    fi
    # `exit`, not a return code: callers write `apt_need ... || true`, where set -e is off.
    if [ -z "$_apt_updated" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq || exit 1
        _apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || exit 1
    APT_INSTALLED+=("${missing[@]}")
}
