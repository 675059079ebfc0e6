#!/usr/bin/env bash
# Vets and tests the otelpgrl module: see scripts/module-test.sh.
#
#   bash otelpgrl/test.sh [go test arguments]
exec bash "$(dirname "$0")/../scripts/module-test.sh" otelpgrl "$@"
