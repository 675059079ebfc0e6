#!/usr/bin/env bash
# Vets and tests the grpclimit module: see scripts/module-test.sh.
#
#   bash grpclimit/test.sh [go test arguments]
exec bash "$(dirname "$0")/../scripts/module-test.sh" grpclimit "$@"
