// Package unitcheck tests the files egressd installs beside its binary:
// the systemd unit (systemd/egressd.service) and the example policy
// (examples/policy.yaml). It has no code of its own.
//
// The unit is checked three ways: systemd-analyze verify reads it as systemd
// will; a parser holds it to the decisions its comments explain (Type=notify,
// the pins writable, every capability justified); and, as root, the datapath
// is loaded, attached and adopted under exactly the unit's capabilities in a
// mount namespace arranged as the unit arranges it, then once more without
// each capability in turn, which must fail, so that the unit asks for
// nothing it does not use.
package unitcheck
