#!/usr/bin/env bash
# Vets and tests the frameworks module: see scripts/module-test.sh.
#
#   bash frameworks/test.sh [go test arguments]
exec bash "$(dirname "$0")/../scripts/module-test.sh" frameworks "$@"
