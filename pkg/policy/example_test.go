package policy_test

import (
	"fmt"
	"net/netip"

	"github.com/egressd/egressd/pkg/loader"
	"github.com/egressd/egressd/pkg/policy"
)

func ExampleParse() {
	_, err := policy.Parse([]byte(`rules:
  - name: payments
    destination: 10.20.0.0/16
    port: 443
    concurency: 50
  - name: email
    destination: smtp.example.com:25
    perSecond: {permits: 0, burst: 20}
`))
	fmt.Println(err)
	// Output:
	// line 2:5: rule payments: no limit: give one of concurrency, perSecond, perWindow or adaptive
	// line 5:5: rule payments: unknown field "concurency" (did you mean concurrency?)
	// line 7:18: rule email: destination "smtp.example.com:25" has a port; write destination: smtp.example.com and port: 25
	// line 8:26: rule email: perSecond.permits must be at least 1
}

func ExampleRule_LoaderRules() {
	p, err := policy.Parse([]byte(`rules:
  - {name: email, destination: smtp.example.com, port: 25, perSecond: {permits: 10}}
`))
	if err != nil {
		panic(err)
	}
	resolved := []netip.Addr{netip.MustParseAddr("192.0.2.25"), netip.MustParseAddr("2001:db8::25")}
	for _, r := range p.Rules[0].LoaderRules(loader.Scope{}, resolved) {
		fmt.Println(r.Name, r.Dest, r.Port, r.Shape, r.Limit, policy.RuleName(r.Name))
	}
	// Output:
	// email#192.0.2.25 192.0.2.25/32 25 per_second 10 email
	// email#2001:db8::25 2001:db8::25/128 25 per_second 10 email
}
