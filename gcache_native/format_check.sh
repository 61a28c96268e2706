#!/usr/bin/env bash
# Checks that every C++ file under gcache_native/ is as clang-format writes it
# (style: gcache_native/.clang-format); exits non-zero naming the lines that
# differ. To fix them: bash gcache_native/format_check.sh --fix
set -euo pipefail
cd "$(dirname "$0")"
if ! command -v clang-format >/dev/null 2>&1; then
  echo "format_check: clang-format is not installed (setup.sh installs it: apt-get install clang-format)"
  exit 1
fi
mapfile -t files < <(find . \( -name '*.cpp' -o -name '*.h' \) -type f | sort)
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  echo "format_check: formatted ${#files[@]} files"
  exit 0
fi
clang-format --dry-run --Werror "${files[@]}"
echo "format_check: ${#files[@]} C++ files match gcache_native/.clang-format ($(clang-format --version))"
