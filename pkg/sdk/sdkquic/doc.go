// Package sdkquic dials QUIC connections whose refusal by egressd the SDK
// tells from a network's: a refused dial's error carries the send the
// kernel refused, which [sdk.DaemonAttributor] asks the daemon about, so
// the attempt is throttled, self-imposed and names the rule.
//
// quic-go turns a refused send into a QUIC transport error whose text
// alone says "operation not permitted": without this package an
// egressd refusal of a QUIC flow is a permanent failure to the SDK.
//
// Its dials have the signature of http3.Transport.Dial:
//
//	tr := &http3.Transport{Dial: sdkquic.DialEarly}
//	rt, err := sdkhttp.NewStack(tr).Retry(sdkhttp.Defaults()).Build()
//
// Each connection has a UDP socket of its own, as quic.DialAddr's do: to
// egressd each is a flow of its own, counted by a concurrency rule and
// ended when the connection closes. (http3.Transport's own dial shares one
// socket between its connections, which a rule counts as one flow per
// server.)
package sdkquic
