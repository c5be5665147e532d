package idemkey_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idemkey/idemkey"
)

// The layouts of RFC 9110's three forms of an HTTP date (section 5.6.7),
// in Go's notation, to write dates the way a peer would.
const (
	imfFixdate = "Mon, 02 Jan 2006 15:04:05 GMT"
	rfc850     = "Monday, 02-Jan-06 15:04:05 GMT"
	asctime    = "Mon Jan _2 15:04:05 2006"
)

// RFC 9110's own example of one instant in the three forms reads as that
// instant in each, which FormatDate writes as the IMF-fixdate.
// TestFormatDate: FormatDate writes what time.Format writes with the
// IMF-fixdate's layout, in UTC, for instants of every part of the calendar
// and zone, and its four-digit years' edges.
func TestFormatDate(t *testing.T) {
	want := func(at time.Time) string { return at.UTC().Format("Mon, 02 Jan 2006 15:04:05 GMT") }
	times := []time.Time{
		{}, time.Unix(0, 0), time.Unix(-1, 999_999_999),
		time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(-1, 12, 31, 23, 59, 59, 0, time.UTC),
		time.Date(9999, 12, 31, 23, 59, 59, 999_999_999, time.UTC), time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC),
		time.Date(2026, 12, 1, 20, 5, 37, 0, time.FixedZone("", -8*3600)),
	}
	for at := time.Date(1969, 1, 1, 0, 0, 0, 0, time.UTC); at.Year() < 2101; at = at.Add(37*time.Hour + 61*time.Minute + 7*time.Second + 13) {
		times = append(times, at)
	}
	// Seconds that share a place among the dates FormatDate keeps, in turn.
	for i := range 4 {
		times = append(times, time.Unix(1_800_000_000+int64(i%2)*64, 0), time.Unix(1_800_000_000+int64(i%2)*64, 999_999_999))
	}
	for range 2 { // the second time, as FormatDate wrote them already
		for _, at := range times {
			if got := idemkey.FormatDate(at); got != want(at) {
				t.Fatalf("FormatDate(%v) = %q, want %q", at, got, want(at))
			}
		}
	}
}

func TestParseDateForms(t *testing.T) {
	for _, v := range []string{
		"Sun, 06 Nov 1994 08:49:37 GMT",
		"Sunday, 06-Nov-94 08:49:37 GMT",
		"Sun Nov  6 08:49:37 1994",
		"Sun Nov 06 08:49:37 1994", // asctime's day may be two digits
	} {
		got, err := idemkey.ParseDate(v)
		if err != nil {
			t.Errorf("ParseDate(%q): %v", v, err)
			continue
		}
		if got.Location() != time.UTC || idemkey.FormatDate(got) != "Sun, 06 Nov 1994 08:49:37 GMT" {
			t.Errorf("ParseDate(%q) = %v, want Sun, 06 Nov 1994 08:49:37 GMT", v, got)
		}
	}
}

// Every day of a year, at a time of its own, written in each form by Go's
// formatter, reads back as itself.
func TestParseDateEveryDay(t *testing.T) {
	start := time.Date(time.Now().Year()-10, time.January, 1, 0, 0, 0, 0, time.UTC)
	for d := range 366 {
		at := start.AddDate(0, 0, d).Add(time.Duration(d*7919) * time.Second % (24 * time.Hour))
		for _, layout := range []string{imfFixdate, rfc850, asctime} {
			v := at.Format(layout)
			if got, err := idemkey.ParseDate(v); err != nil || !got.Equal(at) {
				t.Fatalf("ParseDate(%q) = %v, %v; want %v", v, got, err, at)
			}
		}
	}
}

// An RFC 850 date's two-digit year is read as RFC 9110 says: a date that
// would be more than 50 years in the future is of the century before.
func TestParseDateTwoDigitYear(t *testing.T) {
	now := time.Now().UTC().Truncate(time.Second)
	for _, tc := range []struct {
		years, want int // the date's distance from now in years, as written and as read
	}{
		{0, 0},
		{-1, -1},
		{1, 1},
		{49, 49},
		{-49, -49},
		{51, -49}, // more than 50 years ahead: the century before
		{-51, 49}, // its two digits are 49 years ahead, which is not too far
		{99, -1},
	} {
		written := now.AddDate(tc.years, 0, 0)
		v := written.Format(rfc850)
		got, err := idemkey.ParseDate(v)
		if want := now.AddDate(tc.want, 0, 0); err != nil || !got.Equal(want) {
			t.Errorf("ParseDate(%q) = %v, %v; want %v (%d years from now)", v, got, err, want, tc.want)
		}
	}
}

// A value that is almost an HTTP date, in a way that a peer writing one of
// RFC 9110's forms never writes it, is refused with ErrDate.
func TestParseDateNearMisses(t *testing.T) {
	for _, v := range []string{
		"",
		"yesterday",
		"1994-11-06T08:49:37Z",
		// IMF-fixdate
		"Sun, 06 Nov 1994 08:49:37 UTC",
		"Sun, 06 Nov 1994 08:49:37 +0000",
		"Sun, 06 Nov 1994 08:49:37",
		"sun, 06 nov 1994 08:49:37 GMT",
		"SUN, 06 NOV 1994 08:49:37 GMT",
		"Sun, 6 Nov 1994 08:49:37 GMT",
		"Sun, 06 Nov 1994 8:49:37 GMT",
		"Sun, 06 Nov 1994 08:49:37.5 GMT",
		"Sun, 06 Nov 94 08:49:37 GMT",
		"Sunday, 06 Nov 1994 08:49:37 GMT",
		"Sun 06 Nov 1994 08:49:37 GMT",
		"Sun,  06 Nov 1994 08:49:37 GMT",
		" Sun, 06 Nov 1994 08:49:37 GMT",
		"Sun, 06 Nov 1994 08:49:37 GMT ",
		"Sun, 31 Nov 1994 08:49:37 GMT",
		"Sun, 06 Nov 1994 24:00:00 GMT",
		"Sun, 06 Nov 1994 08:60:37 GMT",
		"Sun, 06 Nov 1994 08:49:37 GMT, Mon, 07 Nov 1994 08:49:37 GMT",
		// RFC 850
		"Sun, 06-Nov-94 08:49:37 GMT",
		"Sunday, 06-Nov-1994 08:49:37 GMT",
		"Sunday, 06-Nov-94 08:49:37 UTC",
		"Sunday, 06-Nov-94 08:49:37",
		"Sunday, 6-Nov-94 08:49:37 GMT",
		"Sunday, 06-nov-94 08:49:37 GMT",
		"sunday, 06-Nov-94 08:49:37 GMT",
		"Sunday 06-Nov-94 08:49:37 GMT",
		"Sunday, 06 Nov 94 08:49:37 GMT",
		"Sunday, 29-Feb-95 08:49:37 GMT",
		// asctime
		"Sun Nov 6 08:49:37 1994",
		"Sun Nov  06 08:49:37 1994",
		"Sun Nov  6 08:49:37 1994 GMT",
		"Sun Nov  6 08:49:37 94",
		"Sunday Nov  6 08:49:37 1994",
		"Sun, Nov  6 08:49:37 1994",
		"Sun nov  6 08:49:37 1994",
		"Sun Nov  6 8:49:37 1994",
	} {
		if got, err := idemkey.ParseDate(v); !errors.Is(err, idemkey.ErrDate) {
			t.Errorf("ParseDate(%q) = %v, %v; want ErrDate", v, got, err)
		}
	}
}

// A client reads a key's expiry in any form of HTTP date, and none from a
// field that is missing, sent twice or not a date.
func TestParseExpires(t *testing.T) {
	at := time.Now().UTC().Add(24 * time.Hour).Truncate(time.Second)
	for _, layout := range []string{imfFixdate, rfc850, asctime} {
		if got, ok := idemkey.ParseExpires([]string{at.Format(layout)}); !ok || !got.Equal(at) {
			t.Errorf("ParseExpires(%q) = %v, %v; want %v", at.Format(layout), got, ok, at)
		}
	}
	for _, values := range [][]string{nil, {}, {idemkey.FormatDate(at), idemkey.FormatDate(at)}, {"tomorrow"}} {
		if got, ok := idemkey.ParseExpires(values); ok {
			t.Errorf("ParseExpires(%q) = %v, true; want false", values, got)
		}
	}
}
